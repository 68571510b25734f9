"""The services' clients: requests to metadata shards (``meta``) and storage nodes (``storage``,
with ``shortcircuit`` reading a same-host node's volumes directly). Nothing above this speaks the
wire."""
