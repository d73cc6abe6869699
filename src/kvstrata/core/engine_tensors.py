"""Engine-supplied device memory: checking an engine's own tensors against a pool's spec.

Kept apart from :mod:`kvstrata.core.buffers` (which builds a tier from them) because the checks
are long and user-facing: every mismatch -- dtype, shape, a unit that is not dense in memory, a
``meta`` tensor, the wrong device -- must say which pool and buffer, what was expected and what
was given, in one ``ValueError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvstrata.core.memory_overlap import Blocks, first_shared, overlaps_itself
from kvstrata.plugins.pool_type import BufferSpec, Layout, PoolSpec

#: what an engine hands over per buffer: one tensor, or one tensor per layer
EngineTensor = torch.Tensor | Sequence[torch.Tensor]


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a spec dtype name (``bfloat16`` -> ``torch.bfloat16``)."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return dtype


def engine_tensor_units(spec: PoolSpec, tensors: Mapping[str, EngineTensor], layout: Layout) -> int | None:
    """The unit count the engine's tensors hold (read from the first buffer's unit dimension).

    ``None`` when there is nothing to read it from; :meth:`PoolBuffers.from_tensors` checks that
    every buffer agrees.
    """
    for buffer in spec.buffers:
        value = tensors.get(buffer.name)
        if isinstance(value, torch.Tensor):
            unit_dim = 1 if Layout(layout) is Layout.LAYER_FIRST else 0
            return int(value.shape[unit_dim]) if value.dim() > unit_dim else None
        if isinstance(value, Sequence) and value and isinstance(value[0], torch.Tensor):
            return int(value[0].shape[0]) if value[0].dim() else None
    return None


def _shape_text(dims: Sequence[tuple[str, int | None]]) -> str:
    return "(" + ", ".join(name if size is None else f"{name}={size}" for name, size in dims) + ")"


def _unit_contiguous(tensor: torch.Tensor, unit_shape: tuple[int, ...]) -> bool:
    """True when the trailing ``unit_shape`` dimensions are laid out densely (C order)."""
    expected = 1
    for size, stride in zip(reversed(unit_shape), reversed(tensor.stride()[-len(unit_shape) :]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _check_engine_tensor(
    where: str, buffer: BufferSpec, given: EngineTensor, units: int, layout: Layout
) -> list[torch.Tensor]:
    """Dtype, shape and unit contiguity of one buffer's engine tensor(s); returns the tensors."""
    dtype = torch_dtype(buffer.dtype)
    dims = list(buffer.unit_dims) or [f"d{i}" for i in range(len(buffer.unit_shape))]
    unit = list(zip(dims, buffer.unit_shape, strict=True))
    label = f"{where} buffer {buffer.name!r}"
    if isinstance(given, torch.Tensor):
        if layout is Layout.LAYER_FIRST:
            expected = [("layers", buffer.layers), ("units", units), *unit]
            form = "one layer_first tensor"
        else:
            expected = [("units", units), ("layers", buffer.layers), *unit]
            form = "one page_first_direct tensor"
        parts = [(label, given, expected, form)]
    elif isinstance(given, Sequence) and not isinstance(given, (str, bytes)):
        if layout is not Layout.LAYER_FIRST:
            raise ValueError(
                f"{label}: per-layer tensors are layer_first; expected one tensor for {layout.value}"
            )
        if len(given) != buffer.layers:
            raise ValueError(f"{label}: expected {buffer.layers} per-layer tensors, got {len(given)}")
        expected = [("units", units), *unit]
        parts = [(f"{label} layer {i}", part, expected, "a per-layer tensor") for i, part in enumerate(given)]
    else:
        raise ValueError(
            f"{label}: expected a torch.Tensor or a sequence of per-layer tensors, got {type(given).__name__}"
        )
    tensors = []
    for what, tensor, expected_dims, form in parts:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{what}: expected a torch.Tensor, got {type(tensor).__name__}")
        shape = tuple(size for _, size in expected_dims)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(
                f"{what}: expected {form} of {dtype} {_shape_text(expected_dims)}, "
                f"got {tensor.dtype} {tuple(tensor.shape)}"
            )
        if not _unit_contiguous(tensor, buffer.unit_shape):
            raise ValueError(
                f"{what}: expected each unit {_shape_text(unit)} contiguous in memory (C order), got "
                f"strides {tuple(tensor.stride())} for shape {tuple(tensor.shape)}; pass a contiguous "
                "tensor or one whose unit dimensions are dense"
            )
        if tensor.numel() and overlaps_itself(Blocks.of(tensor, buffer.unit_shape)):
            raise ValueError(
                f"{what}: expected units that do not share memory, got strides {tuple(tensor.stride())} "
                f"for shape {tuple(tensor.shape)} (a broadcast or overlapping view?): a write to one "
                "unit would change another; pass a tensor with memory for every unit"
            )
        tensors.append(tensor)
    return tensors


def _same_device(given: torch.device, expected: torch.device) -> bool:
    """``expected`` without an index (a bare ``cuda``) accepts any index of its type."""
    return given.type == expected.type and (expected.index is None or given.index == expected.index)


def check_engine_tensors(
    spec: PoolSpec,
    tensors: Mapping[str, EngineTensor],
    units: int | None,
    layout: Layout,
    device: torch.device | str | None,
) -> tuple[int, dict[str, torch.Tensor], dict[str, list[torch.Tensor]], torch.device]:
    """Validate an engine's tensors for every buffer of ``spec`` (dtype, shape, unit contiguity,
    one real device); returns (units, whole tensors, per-layer tensors, device). A mismatch raises
    one ``ValueError`` naming the pool, the buffer, what was expected and what was given."""
    where = f"pool {spec.name!r} ({spec.pool_type})"
    if layout is Layout.PAGE_FIRST:
        raise ValueError(
            f"{where}: engine tensors are one per buffer; page_first interleaves the buffers "
            "in one allocation. Use layer_first or page_first_direct"
        )
    if spec.buffers and layout not in spec.layouts:
        raise ValueError(
            f"{where} does not support layout {layout.value!r}; "
            f"supported: {[lay.value for lay in spec.layouts]}"
        )
    names = [buffer.name for buffer in spec.buffers]
    missing = [name for name in names if name not in tensors]
    unknown = sorted(set(tensors) - set(names))
    if missing or unknown:
        raise ValueError(
            f"{where}: engine tensors must cover exactly its buffers {names}; "
            f"missing {missing}, unknown {unknown}"
        )
    if units is None:
        units = engine_tensor_units(spec, tensors, layout) or 0
    expected_device = None if device is None else torch.device(device)
    found: dict[str, list[torch.Tensor]] = {}
    whole: dict[str, torch.Tensor] = {}
    first_device: torch.device | None = None
    starts: dict[int, str] = {}  # where each buffer's memory begins: no two may share it
    blocks: list[tuple[str, Blocks]] = []  # every part's units: no two may share bytes either
    for buffer in spec.buffers:
        given = tensors[buffer.name]
        parts = _check_engine_tensor(where, buffer, given, units, layout)
        for index, part in enumerate(parts):
            what = f"buffer {buffer.name!r}" + (f" layer {index}" if len(parts) > 1 else "")
            if part.numel() and part.device.type != "meta":
                other = starts.setdefault(part.data_ptr(), what)
                blocks.append((what, Blocks.of(part, buffer.unit_shape)))
                if other != what:
                    raise ValueError(
                        f"{where} {what}: the same memory as {other} (one tensor passed twice?): "
                        "a write to one would change the other; each buffer and layer needs its own"
                    )
            if part.device.type == "meta":
                raise ValueError(
                    f"{where} buffer {buffer.name!r}: expected a tensor with memory "
                    f"(on {expected_device or 'the device tier'}), got one on device 'meta'"
                )
            if expected_device is not None and not _same_device(part.device, expected_device):
                raise ValueError(
                    f"{where} buffer {buffer.name!r}: expected device {expected_device}, got {part.device}"
                )
            if first_device is not None and part.device != first_device:
                raise ValueError(
                    f"{where} buffer {buffer.name!r}: expected every tensor on {first_device} "
                    f"(the device of the first), got {part.device}"
                )
            first_device = part.device
        if isinstance(given, torch.Tensor):
            whole[buffer.name] = given
        else:
            found[buffer.name] = parts
    shared = first_shared(blocks)
    if shared is not None:
        raise ValueError(
            f"{where} {shared[1]}: shares memory with {shared[0]} (overlapping slices of one "
            "allocation?): a write to one would change the other; each buffer and layer needs its own"
        )
    return units, whole, found, first_device or expected_device or torch.device("cpu")
