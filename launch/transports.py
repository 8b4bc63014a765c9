"""How a finished phase's state travels to its successor rank (``launch.handover``): ``cuda``,
CUDA IPC handles of one block per storage (both processes on the same GPU, matched by UUID), and
``host``, the bytes in a 0600 file in the predecessor's phase directory (the same choreography on a
CPU). Nothing is pickled: an offer is JSON, CUDA IPC's handles in it base64."""

from __future__ import annotations

import base64
import os
from pathlib import Path

import torch

from launch.contract.files import Offer, TensorRef

ALIGN = 64
_IPC_FIELDS = ("device", "handle", "size", "offset", "rc_handle", "rc_offset", "event", "event_sync")


def device_id(device: torch.device) -> str:
    if device.type == "cuda":
        return str(torch.cuda.get_device_properties(device).uuid)
    return "host"


def _ref(name: str, t: torch.Tensor, block: int, offset: int) -> TensorRef:
    return TensorRef(name=name, block=block, dtype=str(t.dtype).removeprefix("torch."), shape=list(t.shape),
                     stride=list(t.stride()), offset=offset)


def export_cuda(tensors: dict[str, torch.Tensor]) -> tuple[list[dict], list[TensorRef]]:
    """One IPC handle per storage (a flat buffer's views share one), each tensor a view into it."""
    torch.cuda.synchronize()
    blocks: list[dict] = []
    refs: list[TensorRef] = []
    index: dict[int, int] = {}
    for name, t in tensors.items():
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in index:
            fields = storage._share_cuda_()
            index[key] = len(blocks)
            blocks.append({k: base64.b64encode(v).decode() if isinstance(v, bytes) else v
                           for k, v in zip(_IPC_FIELDS, fields)})
        refs.append(_ref(name, t, index[key], t.storage_offset()))
    return blocks, refs


def export_host(tensors: dict[str, torch.Tensor], blob: Path) -> tuple[list[dict], list[TensorRef]]:
    """Every tensor's bytes, contiguous, into ``blob`` (0600)."""
    blocks: list[dict] = []
    refs: list[TensorRef] = []
    offset = 0
    with os.fdopen(os.open(blob, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        for name, t in tensors.items():
            data = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
            f.seek(offset)
            f.write(memoryview(data))
            blocks.append({"offset": offset, "size": data.nbytes})
            refs.append(_ref(name, t.contiguous(), len(blocks) - 1, 0))
            offset += -(-data.nbytes // ALIGN) * ALIGN
    return blocks, refs


def map_offer(offer: Offer, blob: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Each offered tensor, as a view of the mapped block (cuda) or of this process's copy of the
    file (host). A cuda view must not outlive the copy made of it."""
    if offer.transport == "host":
        data = bytearray(blob.read_bytes())
        whole = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
        return {r.name: whole[offer.blocks[r.block]["offset"]:][:offer.blocks[r.block]["size"]]
                .view(getattr(torch, r.dtype)).as_strided(r.shape, r.stride) for r in offer.tensors}

    storages = [cuda_storage(b, device) for b in offer.blocks]
    return {r.name: view(storages[r.block], r) for r in offer.tensors}


def cuda_storage(block: dict, device: torch.device) -> torch.UntypedStorage:
    """The storage another process exported (``export_cuda``'s fields of one block), mapped here."""
    f = {k: base64.b64decode(v) if isinstance(v, str) else v for k, v in block.items()}
    return torch.UntypedStorage._new_shared_cuda(device.index, f["handle"], f["size"], f["offset"],
                                                 f["rc_handle"], f["rc_offset"], f["event"], f["event_sync"])


def view(storage: torch.UntypedStorage, r: TensorRef) -> torch.Tensor:
    """Tensor ``r`` of an offer or record, a view into ``storage``."""
    return torch.empty(0, dtype=getattr(torch, r.dtype), device=storage.device).set_(storage, r.offset, r.shape,
                                                                                      r.stride)
