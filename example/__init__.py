"""example"""
