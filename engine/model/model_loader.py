"""`load_model`: a ModelSource -> (ModelConfig, decoder) on the chosen device and dtype, for one
tensor-parallel rank (the whole model for a single one).

    registry: the checkpoint's architecture -> its ModelFamily -> config
    family.build(config, parallel) on the meta device: the rank's module, no memory yet
    family.checkpoint_layout(config): each parameter <- its checkpoint tensors and split
    per parameter: read this rank's slice of each source, concatenate, adopt it

One tensor is read at a time, and only the rank's slice of it, so a rank never holds the
unsharded model. Every checkpoint tensor's full shape is checked against the unsharded model
first, so a damaged or mismatched checkpoint fails with its tensor named, whatever the rank count.
"""

from __future__ import annotations

import logging
from contextlib import AbstractContextManager

import torch
from torch import nn

from kvserve.engine.model.checkpoint import Checkpoint
from kvserve.engine.model.gguf_checkpoint import GGUFCheckpoint
from kvserve.engine.model.gguf_metadata import GGUFFields, read_gguf
from kvserve.engine.model.llama import gguf_window_note
from kvserve.engine.model.model_config import ModelConfig
from kvserve.engine.model.model_errors import CorruptModelError
from kvserve.engine.model.model_family import ModelFamily, Split, WeightTarget
from kvserve.engine.model.model_source import ModelSource
from kvserve.engine.model.parallel_layers import ParallelWrapper
from kvserve.engine.model.protocol import CausalLM
from kvserve.engine.model.registry import family_of, load_model_config, model_config_from_gguf
from kvserve.engine.model.renamed_checkpoint import RenamedCheckpoint
from kvserve.engine.model.safetensors_checkpoint import SafetensorsCheckpoint
from kvserve.engine.model.tensor_parallel import SINGLE, TensorParallel

logger = logging.getLogger(__name__)

Slot = tuple[nn.Module, str]  # (module, parameter attribute)


def load_model(source: ModelSource, dtype: torch.dtype, device: torch.device,
               parallel: TensorParallel = SINGLE) -> tuple[ModelConfig, CausalLM]:
    device = torch.device(device)
    if source.format == "gguf":
        reader = read_gguf(source.path)
        config = model_config_from_gguf(reader, source.path)
        family = family_of(config)
        note = gguf_window_note(GGUFFields(reader, source.path))
        if note is not None and parallel.rank == 0:
            logger.warning(note)
        checkpoint: AbstractContextManager[Checkpoint] = GGUFCheckpoint(reader, source.path, family, config)
    else:
        config = load_model_config(source.path)
        family = family_of(config)
        checkpoint = SafetensorsCheckpoint(source.path)
    with checkpoint as opened:
        return config, build_model(family, config, opened, dtype, device, parallel)


def build_model(family: ModelFamily, config: ModelConfig, checkpoint: Checkpoint, dtype: torch.dtype,
                device: torch.device, parallel: TensorParallel = SINGLE) -> CausalLM:
    """Builds the rank's module on the meta device and adopts its slice of every weight."""
    layout = family.checkpoint_layout(config)
    if layout.renames:
        checkpoint = RenamedCheckpoint(checkpoint, layout.renames)
    _check_names(checkpoint, layout.targets, layout.ignored, layout.ignored_prefixes)
    with torch.device("meta"):
        full_shapes = {name: getattr(*slot).shape for name, slot in _slots(family.build(config, SINGLE)).items()}
        model = family.build(config, parallel)
    slots = _slots(model)
    sharing = _sharing(slots)
    for target in layout.targets:
        _check_full_shape(checkpoint, target, full_shapes[target.name])
        tensor = _read_slice(checkpoint, target, parallel, dtype, device)
        module, attr = slots[target.name]
        if tensor.shape != getattr(module, attr).shape:  # the split's arithmetic, not the checkpoint
            raise CorruptModelError(f"{checkpoint.where}: rank {parallel.rank}'s slice of {target.name!r} has shape "
                                    f"{tuple(tensor.shape)}, its module {tuple(getattr(module, attr).shape)}")
        parameter = nn.Parameter(tensor, requires_grad=False)
        for shared_module, shared_attr in sharing[id(getattr(module, attr))]:
            setattr(shared_module, shared_attr, parameter)  # tied weights stay one tensor
    model.to(device)  # buffers derived from the config (rope tables) were built on the CPU
    unloaded = [name for name, tensor in (*model.named_parameters(), *model.named_buffers()) if tensor.is_meta]
    if unloaded:
        raise CorruptModelError(f"{checkpoint.where}: the checkpoint layout leaves {unloaded[:5]} unloaded")
    return model.eval().requires_grad_(False)


def _slots(model: nn.Module, prefix: str = "") -> dict[str, Slot]:
    """Every parameter under its checkpoint-layout name: a parallel wrapper's inner layer
    (`o_proj.linear.weight`) answers to the wrapper's name (`o_proj.weight`)."""
    slots: dict[str, Slot] = {f"{prefix}{name}": (model, name) for name, _ in model.named_parameters(recurse=False)}
    for name, child in model.named_children():
        inner = isinstance(model, ParallelWrapper) and name == "linear"
        slots |= _slots(child, prefix if inner else f"{prefix}{name}.")
    return slots


def _sharing(slots: dict[str, Slot]) -> dict[int, list[Slot]]:
    """Slots by the identity of the parameter they hold now (tied weights share one)."""
    by_parameter: dict[int, list[Slot]] = {}
    for module, attr in slots.values():
        by_parameter.setdefault(id(getattr(module, attr)), []).append((module, attr))
    return by_parameter


def _check_names(checkpoint: Checkpoint, targets: tuple[WeightTarget, ...], ignored: frozenset[str],
                 ignored_prefixes: tuple[str, ...] = ()) -> None:
    expected = {source for target in targets for source in target.sources}
    unexpected = sorted(n for n in checkpoint.names() - expected - ignored if not n.startswith(ignored_prefixes))
    if unexpected:
        raise CorruptModelError(f"{checkpoint.where}: unexpected weights {unexpected[:5]}"
                                f"{' ...' if len(unexpected) > 5 else ''}; the checkpoint does not match its config")


def _check_full_shape(checkpoint: Checkpoint, target: WeightTarget, expected: torch.Size) -> None:
    shapes = [checkpoint.shape(source) for source in target.sources]
    if len({shape[1:] for shape in shapes}) == 1:
        found = (sum(shape[0] for shape in shapes), *shapes[0][1:]) if shapes[0] else ()
    else:
        found = shapes  # sources that cannot even be concatenated
    if tuple(found) != tuple(expected):
        raise CorruptModelError(f"{checkpoint.where}: weight {target.name!r} has shape {tuple(found)}, "
                                f"the config implies {tuple(expected)}")


def _read_slice(checkpoint: Checkpoint, target: WeightTarget, parallel: TensorParallel, dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
    parts = []
    for source in target.sources:
        if target.split is Split.REPLICATED or not parallel.is_sharded:
            parts.append(checkpoint.read(source, None, 0, 0, dtype, device))
            continue
        dim = 1 if target.split is Split.ROW else 0
        size = checkpoint.shape(source)[dim]
        if target.split is Split.VOCAB:
            start, stop = parallel.vocab_range(size)
            rows = checkpoint.read(source, 0, start, min(stop, size), dtype, device)
            parts.append(torch.cat([rows, rows.new_zeros(stop - start - rows.shape[0], *rows.shape[1:])])
                         if rows.shape[0] < stop - start else rows)
            continue
        for offset, section in _sections(target, size):
            if section % parallel.world_size:
                raise CorruptModelError(f"{checkpoint.where}: {source!r} ({section} along dim {dim}) does not split "
                                        f"over {parallel.world_size} tensor-parallel ranks")
            start, stop = parallel.range_of(section)
            parts.append(checkpoint.read(source, dim, offset + start, offset + stop, dtype, device))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _sections(target: WeightTarget, size: int) -> list[tuple[int, int]]:
    """(first row, rows) of each section of a source a column split cuts separately: the whole
    source, or the parts of a fused one (WeightTarget.sections)."""
    if not target.sections:
        return [(0, size)]
    if target.split is not Split.COLUMN or len(target.sources) != 1 or sum(target.sections) != size:
        raise CorruptModelError(f"{target.sources[0]!r}: {size} rows do not make the sections {target.sections} "
                                f"of {target.name!r}")
    offsets = [sum(target.sections[:i]) for i in range(len(target.sections))]
    return list(zip(offsets, target.sections))
