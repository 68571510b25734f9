"""jpfs/cli"""
