"""jpfs/lerobot"""
