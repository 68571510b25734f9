"""LeRobot datasets on JPFS: the v2.1 and v3.0 layouts, a metadata reader, a synthetic generator,
and the v2.1 -> v3.0 converter.

- ``layout``   path templates, constants, features and info.json builders
- ``dataset``  ``load_meta(root)`` / ``detect_version(root)``: one view of both layouts
- ``generate`` ``generate(root, episodes=..., cameras=..., format=...)``: synthetic datasets
- ``convert``  ``convert(src, dst, ...)``: parallel, resumable v2.1 -> v3.0
- ``verify``   ``verify(src, dst)``: frame-by-frame check of a conversion
- ``video``    tiny encodes, stand-ins, probing and stream-copy concatenation (PyAV)
- ``stats``    per-episode and aggregated feature statistics

Roots are local paths or fsspec URLs (``jpfs://a/b``); submodules are imported on use.
"""
