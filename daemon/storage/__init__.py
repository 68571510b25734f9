"""daemon/storage"""
