"""Image features: camera frames stored inside the parquet (``LeRobotDataset.create(use_videos=
False)``), one PNG or JPEG per row in a ``struct<bytes: binary, path: string>`` column.

Decoded with Pillow, the library LeRobot (through HF datasets and torchvision's ``ToTensor``)
decodes them with, so pixels match exactly; JPEG decoders differ between libraries.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa


def have_pillow() -> bool:
    """Whether Pillow (what LeRobot decodes image features with) can be imported."""
    try:
        import PIL.Image  # noqa: F401
    except ImportError:
        return False
    return True


def image_bytes(col: pa.ChunkedArray | pa.Array, name: str) -> np.ndarray:
    """The encoded images of a column as an object array of ``bytes`` (None where missing)."""
    arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
    if pa.types.is_struct(arr.type):
        if arr.type.get_field_index("bytes") < 0:
            raise ValueError(f"image feature {name!r}: struct column without a 'bytes' field")
        arr = arr.field("bytes")
    elif not (pa.types.is_binary(arr.type) or pa.types.is_large_binary(arr.type)):
        raise ValueError(f"image feature {name!r}: column of type {arr.type}, expected "
                         "struct<bytes, path> or binary")
    return arr.to_numpy(zero_copy_only=False)


def decode(blob: Any, name: str) -> np.ndarray:
    """One image as ``(H, W, C)`` uint8, as ``torchvision.transforms.ToTensor`` sees it.

    Raises ValueError for a missing image or a mode that is not 8 bits per channel (ToTensor
    would not scale those to [0, 1]).
    """
    from PIL import Image

    if blob is None:
        raise ValueError(f"image feature {name!r}: a row has no image bytes (only a path); "
                         "embed the images in the parquet (LeRobot's embed_images)")
    with Image.open(io.BytesIO(blob)) as img:
        mode = img.mode
        a = np.array(img)
    if mode == "1":
        a = a.astype(np.uint8) * 255  # ToTensor: 255 * img for bilevel images
    if a.dtype != np.uint8:
        raise ValueError(f"image feature {name!r}: mode {mode} ({a.dtype}) is not supported; "
                         "only 8-bit images (L, P, RGB, RGBA, ...)")
    return a[:, :, None] if a.ndim == 2 else a


def decode_many(blobs: np.ndarray, name: str) -> np.ndarray:
    """``(n, H, W, C)`` uint8 for an object array of encoded images; each distinct one decoded
    once (windows of neighbouring frames overlap)."""
    flat = blobs.reshape(-1)
    seen: dict[int, int] = {}
    slot = np.empty(len(flat), dtype=np.int64)
    order: list[Any] = []
    for i, b in enumerate(flat):
        k = id(b)
        j = seen.get(k)
        if j is None:
            j = seen[k] = len(order)
            order.append(b)
        slot[i] = j
    decoded = [decode(b, name) for b in order]
    shapes = {d.shape for d in decoded}
    if len(shapes) > 1:
        raise ValueError(f"image feature {name!r}: images of different shapes {sorted(shapes)}")
    stack = np.stack(decoded) if decoded else np.empty((0, 0, 0, 3), np.uint8)
    return stack[slot].reshape(*blobs.shape, *stack.shape[1:])
