"""jpfs/fuse"""
