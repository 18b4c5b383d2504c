"""classifier"""
