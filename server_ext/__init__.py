"""server_ext"""
