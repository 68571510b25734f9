"""daemon/meta"""
