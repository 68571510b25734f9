"""jpfs/client"""
