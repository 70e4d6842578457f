"""Write tensors into safetensors shards as Hugging Face lays them out (model.safetensors, or
model-0000N-of-0000M.safetensors with model.safetensors.index.json), one piece at a time.

Each tensor arrives as C-order chunks of float32 values and is converted and written chunk by
chunk: every header is known before any value is computed (the shapes and the dtype say where
each tensor lies), so the peak memory is one chunk, however large the model or a shard. The
safetensors package's writers take a whole file's tensors at once (and numpy has no bf16), so
the few lines of its format (a little-endian header length, the JSON header, the raw data) are
written here.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from tqdm import tqdm

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_HEADER_ALIGNMENT = 8  # the data then starts 8-byte aligned, as the safetensors writer pads it
# a chunk is converted this many values at a time: the bf16 rounding's temporaries take about
# 20 bytes a value, five times the float32 chunk itself
_CONVERT_VALUES = 1 << 20


@dataclass(frozen=True)
class TensorSource:
    """One tensor to write: `chunks()` yields its float32 values in C order, in pieces whose
    sizes add up to the shape's."""

    name: str
    shape: tuple[int, ...]
    chunks: Callable[[], Iterable[np.ndarray]]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def slices(self) -> Iterator[np.ndarray]:
        """The values one index of the first axis at a time (chunks hold whole slices)."""
        for chunk in self.chunks():
            yield from chunk.reshape(-1, *self.shape[1:])


@dataclass(frozen=True)
class _Format:
    code: str  # the safetensors dtype name
    itemsize: int
    convert: Callable[[np.ndarray], np.ndarray]


def _to_bfloat16(values: np.ndarray) -> np.ndarray:
    # numpy has no bfloat16: the gguf package's rounding (ggml's: to nearest even, NaN kept quiet)
    return quantize(values, GGMLQuantizationType.BF16)


FORMATS = {
    "float32": _Format("F32", 4, lambda values: values.astype(np.float32, copy=False)),
    "float16": _Format("F16", 2, lambda values: values.astype(np.float16)),
    "bfloat16": _Format("BF16", 2, _to_bfloat16),
}


def shard_plan(tensors: list[TensorSource], itemsize: int, max_shard_bytes: int) -> list[list[int]]:
    """Indices of `tensors` per shard, in order: a shard takes tensors until the next would
    pass `max_shard_bytes` (Hugging Face's rule; a tensor larger than that has a shard alone)."""
    shards: list[list[int]] = [[]]
    size = 0
    for index, tensor in enumerate(tensors):
        nbytes = tensor.numel * itemsize
        if size + nbytes > max_shard_bytes and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(index)
        size += nbytes
    return shards


def write_shards(
    tensors: list[TensorSource], folder: Path, dtype: str, max_shard_bytes: int
) -> list[Path]:
    """Write `tensors` in `dtype` (a FORMATS key) into `folder`; returns the shard files."""
    form = FORMATS[dtype]
    shards = shard_plan(tensors, form.itemsize, max_shard_bytes)
    names = shard_names(len(shards))
    with tqdm(total=len(tensors), desc="converting tensors", unit="tensor") as progress:
        for name, indices in zip(names, shards):
            write_shard(folder / name, [tensors[i] for i in indices], form, progress.update)
    if len(shards) > 1:
        weight_map = {tensors[i].name: name for name, shard in zip(names, shards) for i in shard}
        total = sum(t.numel for t in tensors) * form.itemsize
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return [folder / name for name in names]


def shard_names(count: int) -> list[str]:
    if count == 1:
        return [SINGLE_FILE]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_shard(
    path: Path, tensors: list[TensorSource], form: _Format, done: Callable[[], object]
) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for tensor in tensors:
        end = offset + tensor.numel * form.itemsize
        header[tensor.name] = {
            "dtype": form.code,
            "shape": list(tensor.shape),
            "data_offsets": [offset, end],
        }
        offset = end
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % _HEADER_ALIGNMENT)
    with path.open("wb") as file:
        file.write(len(encoded).to_bytes(8, "little"))
        file.write(encoded)
        for tensor in tensors:
            written = sum(file.write(piece) for piece in converted_pieces(tensor, form))
            if written != tensor.numel * form.itemsize:
                raise ValueError(
                    f"tensor {tensor.name}: {written} bytes produced, its shape "
                    f"{tensor.shape} takes {tensor.numel * form.itemsize}"
                )
            done()


def converted_pieces(tensor: TensorSource, form: _Format) -> Iterator[memoryview]:
    for chunk in tensor.chunks():
        flat = np.ascontiguousarray(chunk).reshape(-1)
        for start in range(0, flat.size, _CONVERT_VALUES):
            piece = form.convert(flat[start : start + _CONVERT_VALUES])
            yield memoryview(np.ascontiguousarray(piece)).cast("B")
