"""A run's checkpoints as one object: how each is named, which are committed and whole, the newest
whole one, the layer sources a checkpoint composes from, retention, setting aside, and what
killed writers left. No torch here: the orchestrator, a phase and ``shard-tools`` all ask it, and
none of them names a checkpoint's files.

    store = Checkpoints(run_dir)
    store.at(30)                      # RUN_DIR/checkpoints/step-00000030, committed or not
    store.newest_whole()              # the newest checkpoint whose manifest and checksums hold
    store.layer_sources(ckpt)         # layer -> the checkpoint its newest weights are in
    for done in store.purge(2, set()): ...   # retention: what no kept checkpoint needs goes

A phase's own state goes in and out of one checkpoint through ``shard_tools.state``.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator

import psutil

from shard_tools.errors import CheckpointError, InputError
from shard_tools.files import TMP_PREFIX, fsync_path, write_atomic
from shard_tools.digest import digest_fd
from shard_tools.header import copy_tensors, tensor_headers
from shard_tools.manifest import (
    FINAL, MANIFEST, STEP_DIR_SHAPE, FileEntry, Manifest, checkpoints_dir, is_checkpoint_dir, layer_of, layers_said,
    listing_fault, read_manifest, step_dir_name, step_of, trimmed_name, verify_checkpoint,
)

SET_ASIDE = ".set-aside-"
"""checkpoints/.set-aside-<time>-<pid>/: where ``set_aside_after`` moves checkpoints; nothing reads or deletes them."""


@dataclass(frozen=True)
class RestorePoint:
    """The newest checkpoint that is whole with its layer sources (None: none is), and the fault of
    every newer one that was skipped, by checkpoint."""

    path: Path | None
    manifest: Manifest | None
    skipped: list[tuple[Path, str]]


@dataclass(frozen=True)
class Purged:
    """What retention did to one checkpoint: removed it, or kept only its layers file (``removed`` False)."""

    path: Path
    removed: bool


@dataclass(frozen=True)
class SetAside:
    """Where ``set_aside_after`` moved the later checkpoints (by name) and the run's final model."""

    folder: Path
    checkpoints: list[str]


class LostLayer(CheckpointError):
    """A checkpoint's recorded layer source is gone or not the one recorded: a damaged run."""

    def __init__(self, message: str, layer: int, source: str):
        super().__init__(message)
        self.layer, self.source = layer, source


class Checkpoints:
    """The checkpoints of the run in ``run_dir``. ``trusted``: checkpoints this process verified with
    checksums or committed itself, which it does not read again."""

    def __init__(self, run_dir: Path):
        self.run_dir = Path(run_dir)
        self.root = checkpoints_dir(self.run_dir)
        self.trusted: set[Path] = set()

    # -- naming ------------------------------------------------------------------------------
    def at(self, step: int) -> Path:
        """The checkpoint at global step ``step``, whether it is there or not."""
        return self.root / step_dir_name(step)

    def all(self) -> list[Path]:
        """Every checkpoint folder, oldest first, whether whole or not (temporaries and set-aside ones excluded)."""
        if not self.root.is_dir():
            return []
        return sorted((p for p in self.root.iterdir() if is_checkpoint_dir(p)), key=lambda p: step_of(p) or 0)

    def upto(self, step: int) -> list[Path]:
        """``all`` at or before global step ``step``."""
        return [c for c in self.all() if (step_of(c) or 0) <= step]

    # -- one checkpoint ------------------------------------------------------------------------
    def committed(self, ckpt: Path) -> bool:
        """Its writer has renamed it into place (its manifest is there): what a reader waits for."""
        return (ckpt / MANIFEST).exists()

    def wait_committed(self, ckpt: Path, poll: float = 0.005) -> None:
        """Until ``ckpt`` is committed; its writer's death is for the caller's supervisor to see."""
        while not self.committed(ckpt):
            time.sleep(poll)

    def faults(self, ckpt: Path, checksums: bool = True) -> list[str]:
        """Every fault of ``ckpt``, each naming its file; none where it is whole."""
        return verify_checkpoint(ckpt, checksums=checksums)

    def manifest(self, ckpt: Path) -> Manifest:
        return read_manifest(ckpt)

    def trust(self, ckpt: Path) -> None:
        """``ckpt`` was committed by, or verified in, this process: not verified again."""
        self.trusted.add(ckpt)

    def _verified(self, ckpt: Path) -> list[str]:
        if ckpt in self.trusted:
            return []
        faults = verify_checkpoint(ckpt)
        if not faults:
            self.trusted.add(ckpt)
        return faults

    # -- the run's ---------------------------------------------------------------------------
    def whole(self, checksums: bool = True) -> Iterator[tuple[Path, Manifest | None, list[str]]]:
        """(checkpoint, manifest or None, faults) for every checkpoint, newest first."""
        for ckpt in reversed(self.all()):
            faults = verify_checkpoint(ckpt, checksums=checksums)
            yield ckpt, (None if faults else read_manifest(ckpt)), faults

    def newest_whole(self, checksums: bool = True) -> tuple[Path | None, Manifest | None, list[str]]:
        """The newest whole checkpoint and the faults of every newer one that was skipped."""
        skipped: list[str] = []
        for ckpt, manifest, faults in self.whole(checksums):
            if manifest is not None and not manifest.layers_only:
                return ckpt, manifest, skipped
            skipped.extend(faults)
        return None, None, skipped

    def layer_sources(self, upto: Path) -> dict[int, Path]:
        """For each body layer, the checkpoint at or before ``upto`` its weights at ``upto`` are in.

        A checkpoint that records its sources (``Manifest.layer_sources``) is followed: LostLayer
        where one it names is gone, replaced, or does not hold the layer, never an older copy or the
        base model's. Before the newest one that records them, by manifests alone (checkpoints
        written before the record): the newest whose layers file holds the layer, damaged ones
        included (skipping one would silently compose an older layer). Callers verify the sources
        they get; an unreadable manifest at or before ``upto`` raises, one ``gone_since_listed`` is skipped.
        """
        limit = step_of(upto)
        assert limit is not None, upto
        return self._sources(self.upto(limit), upto.name)

    def lost_source(self, ckpt: Path) -> LostLayer | None:
        """Where ``ckpt`` records its layer sources and one of them is lost: that fault (manifest
        level); None otherwise, and for a checkpoint without the record (nothing to judge by) or
        whose own manifest or an earlier one cannot be read (their own faults)."""
        try:
            m = read_manifest(ckpt)
            if m.layer_sources is not None and not m.layers_only:
                self.layer_sources(ckpt)
        except LostLayer as e:
            return e
        except CheckpointError:
            pass
        return None

    def sources_before(self, step: int, own: list[int]) -> dict[str, dict[str, str]]:
        """The record a checkpoint written at ``step`` keeps (``Manifest.layer_sources``): each layer
        the checkpoints before it trained that its own layers file (``own``) does not hold."""
        name = step_dir_name(step)
        sources = self._sources([c for c in self.all() if (step_of(c) or 0) < step], name)
        return {str(l): {"checkpoint": src.name, "sha256_chunked": self.manifest(src).layers_sha256}
                for l, src in sorted(sources.items()) if l not in own}

    def _sources(self, ckpts: list[Path], reader: str) -> dict[int, Path]:
        sources: dict[int, Path] = {}
        for ckpt in reversed(ckpts):
            try:
                m = read_manifest(ckpt)
            except CheckpointError as e:
                if gone_since_listed(ckpt):
                    continue
                raise CheckpointError(f"{e}; {reader} may compose layers from it") from None
            for layer in m.stored_layers:
                sources.setdefault(layer, ckpt)
            if m.layer_sources is not None and not m.layers_only:
                for key, entry in m.layer_sources.items():
                    if int(key) not in sources:
                        sources[int(key)] = self._recorded(ckpt, int(key), entry)
                return sources
        return sources

    def _recorded(self, ckpt: Path, layer: int, entry: dict[str, str]) -> Path:
        """The source ``ckpt``'s record names for ``layer``, checked at the manifest level."""
        src = self.root / entry["checkpoint"]
        lost = (f"layer {layer}: {ckpt.name} composes it from {entry['checkpoint']}, which {{}}; the layer's "
                f"trained weights are lost (never taken from an older copy or the base model)")
        try:
            m = read_manifest(src)
        except CheckpointError as e:
            raise LostLayer(lost.format("is missing" if not os.path.lexists(src) else f"cannot be read ({e})"), layer, src.name) from None
        if layer not in m.stored_layers:
            raise LostLayer(lost.format(f"does not hold it (it holds {m.stored_layers})"), layer, src.name)
        if entry["sha256_chunked"] != m.layers_sha256:
            raise LostLayer(lost.format("was replaced (its layers file is not the one recorded)"), layer, src.name)
        return src

    def source_faults(self, ckpt: Path, cached: bool = True, lost: list[str] | None = None) -> list[str]:
        """The faults of the checkpoints ``ckpt`` composes its layers from (itself excluded), with
        checksums (``cached``: once per checkpoint per process); and of every other one before it
        whose manifest lists other layers than its layers file holds: one that lost a layer from its
        list would have been that layer's source. A lost source (``LostLayer``) is also added to ``lost``."""
        try:
            sources = set(self.layer_sources(ckpt).values()) - {ckpt}
        except LostLayer as e:
            if lost is not None:
                lost.append(str(e))
            return [str(e)]
        except CheckpointError as e:
            return [str(e)]
        verify = self._verified if cached else verify_checkpoint
        faults = [f for src in sorted(sources) for f in verify(src)]
        others = [c for c in self.upto(step_of(ckpt)) if c != ckpt and c not in sources]
        return faults + [f for c in others if (f := listing_fault(c))]

    def restore_point(self) -> RestorePoint:
        """The newest checkpoint that is whole, and whose layer sources are whole too. Checksums are
        read once per checkpoint per process (``trusted``). LostLayer where a newer one lost a layer
        source and no older one is whole: starting again from the base model is not a resume."""
        skipped: list[tuple[Path, str]] = []
        lost: list[str] = []
        for ckpt in reversed(self.all()):
            faults = self._verified(ckpt)
            if not faults and read_manifest(ckpt).layers_only:
                continue
            faults = faults or self.source_faults(ckpt, lost=lost)
            if not faults:
                return RestorePoint(ckpt, read_manifest(ckpt), skipped)
            skipped += [(ckpt, f) for f in faults]
        if lost:
            raise CheckpointError(f"{self.run_dir}: a damaged run, no checkpoint holds every layer it trained: {lost[0]}")
        return RestorePoint(None, None, skipped)

    def resume_point(self, given: Path) -> Path:
        """The checkpoint ``given`` names, checked: one of this run's, whole (checksums), and so are
        the layer files it builds on; InputError naming what is wrong otherwise."""
        ckpt = Path(given).resolve()
        if ckpt.parent != self.root.resolve() or not is_checkpoint_dir(ckpt):
            raise InputError(f"expected a checkpoint of this run ({self.root}/{STEP_DIR_SHAPE}), got {given}")
        lost: list[str] = []
        faults = verify_checkpoint(ckpt) or self.source_faults(ckpt, cached=False, lost=lost)  # the user's pick: read now
        if lost:
            raise CheckpointError(f"{given}: a damaged run: {lost[0]}")
        if faults:
            raise InputError(f"{given} is not whole:\n  " + "\n  ".join(faults))
        if read_manifest(ckpt).layers_only:
            raise InputError(f"{given} holds layers only (retention dropped its head and state; the checkpoints "
                             f"after it compose layers from it): give one of the newest checkpoint.keep_last")
        return self.root / ckpt.name

    def newest_phase_end(self, upto: int, since: float) -> Path | None:
        """The newest phase-end checkpoint at or before step ``upto`` committed at ``since`` or later
        (not one an earlier attempt left); OSError or CheckpointError where one is being replaced."""
        for ckpt in reversed(self.upto(upto)):
            m = read_manifest(ckpt)
            if m.phase_complete and not m.layers_only and m.created >= since:
                return ckpt
        return None

    # -- what changes the run's checkpoints ----------------------------------------------------
    def purge(self, keep_last: int, protect: set[Path]) -> Iterator[Purged]:
        """Retention: keeps the newest ``keep_last`` full checkpoints (and ``protect``, which a phase
        may still be reading) whole; of every older whole checkpoint a kept one composes layers
        from, keeps only those layers (dropping its head, state and body optimizer state, and
        trimming its layers file to them), and removes the rest; yields each once done: the
        layers-only ones (oldest first), then the removed ones (newest first). The sources of
        ``protect`` are not trimmed (their readers may hold the manifest that names the file).
        CheckpointError, before anything changes, where an older manifest cannot be read: what it
        holds might be needed."""
        whole = [c for c in self.all() if not verify_checkpoint(c, checksums=False)]
        manifests = {c: read_manifest(c) for c in whole}
        kept = list(dict.fromkeys([c for c in whole if not manifests[c].layers_only][-keep_last:] + sorted(protect)))
        needs: dict[Path, set[int]] = {}  # source -> the layers kept checkpoints compose from it
        untrimmed: set[Path] = set()  # the sources of ``protect``
        for ckpt in kept:
            sources = self.layer_sources(ckpt)
            for layer, src in sources.items():
                needs.setdefault(src, set()).add(layer)
            if ckpt in protect:
                untrimmed |= set(sources.values())
        older = [c for c in whole if c not in kept]
        # A record (``Manifest.layer_sources``) names older checkpoints: those kept for their layers
        # lose theirs first, and the rest go newest first, so that a reader never finds a full
        # checkpoint whose recorded source is gone.
        for ckpt in (c for c in older if c in needs):
            if _keep_layers(ckpt, manifests[ckpt], None if ckpt in untrimmed else needs[ckpt]):
                yield Purged(ckpt, removed=False)
        for ckpt in reversed([c for c in older if c not in needs]):
            trash = ckpt.with_name(f"{TMP_PREFIX}removing-{ckpt.name}.{os.getpid()}")
            os.replace(ckpt, trash)
            shutil.rmtree(trash)
            yield Purged(ckpt, removed=True)

    def set_aside_after(self, chosen: Path) -> SetAside | None:
        """The checkpoints after ``chosen``, and the run's final model made from them, moved to
        ``checkpoints/.set-aside-<time>-<pid>/``, never deleted; None where there is nothing to move."""
        later = [c for c in self.all() if step_of(c) > step_of(chosen)]
        final = self.run_dir / FINAL
        if not later and not final.exists():
            return None
        aside = self.root / f"{SET_ASIDE}{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        aside.mkdir(mode=0o750)
        for ckpt in later:
            os.replace(ckpt, aside / ckpt.name)
        if final.exists():  # the run writes it anew
            os.replace(final, aside / FINAL)
        fsync_path(self.root)
        self.trusted.add(chosen)
        return SetAside(aside, [c.name for c in later])

    # -- what killed writers left ----------------------------------------------------------------
    def stray_temporaries(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if p.name.startswith(TMP_PREFIX))

    def being_written(self) -> tuple[list[Path], list[Path]]:
        """The temporaries split in two: those of a process running on this machine (a live run's
        checkpoint being written, or one retention is removing), and the rest, left by writers that
        are gone (or, on a file system several nodes share, written from another node)."""
        live, left = [], []
        for p in self.stray_temporaries():
            pid = _pid_of(p.name)
            (live if pid is not None and pid > 0 and psutil.pid_exists(pid) else left).append(p)
        return live, left

    def remove_stray_temporaries(self) -> list[Path]:
        """Removes what killed writers left behind, once none can still write; returns what it removed."""
        gone = self.stray_temporaries()
        for p in gone:
            _remove(p)
        return gone

    def remove_temporaries_of(self, pids: set[int]) -> list[Path]:
        """Removes the temporaries (``.tmp-<what>.<pid>[.<n>]``) of processes that are gone."""
        gone = [p for p in self.stray_temporaries() if _pid_of(p.name) in pids]
        for p in gone:
            _remove(p)
        return gone


def gone_since_listed(ckpt: Path) -> bool:
    """Whether a listed checkpoint folder is no longer there: a run's retention (``purge``, in the
    orchestrator, while phases and shard-tools read) renames a checkpoint away whole, and only one
    that no kept checkpoint, nor one a waiting phase reads, composes its layers from. A reader skips
    it; a folder still there with a fault is a fault."""
    return not os.path.lexists(ckpt)


def _keep_layers(ckpt: Path, manifest: Manifest, layers: set[int] | None) -> bool:
    """Makes ``ckpt`` layers-only, its layers file holding only ``layers`` (None: all it holds):
    a trimmed copy first, under a name of its own (``trimmed_name``), then the manifest (the commit
    point), then the files it no longer lists go (also where an earlier retention was killed in
    between). False where nothing changed."""
    m = manifest
    if layers is not None and set(m.stored_layers) - layers:
        m = _trimmed(ckpt, m, layers)
    if m is not manifest or not manifest.layers_only:
        write_atomic(ckpt / MANIFEST, replace(m, layers_only=True, files={m.layers_name: m.files[m.layers_name]}).to_json())
    unlisted = [f for f in ckpt.iterdir() if f.name not in (MANIFEST, m.layers_name)]
    for f in unlisted:
        _remove(f)
    if unlisted:
        fsync_path(ckpt)
    return m is not manifest or not manifest.layers_only or bool(unlisted)


def _trimmed(ckpt: Path, manifest: Manifest, layers: set[int]) -> Manifest:
    """A copy of ``ckpt``'s layers file holding only ``layers`` of them, written and made durable
    beside it; the manifest that lists it (not written yet)."""
    src = ckpt / manifest.layers_name
    _, metadata = tensor_headers(src)
    _, prefix = layers_said(src, metadata)
    kept = [l for l in manifest.stored_layers if l in layers]
    tmp = ckpt / f"{TMP_PREFIX}trimmed.{os.getpid()}"
    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
    try:
        copy_tensors(src, fd, lambda name: layer_of(src, name, prefix) in layers,
                     {**metadata, "layers": ",".join(map(str, kept))})
        os.fsync(fd)
        entry = FileEntry(os.fstat(fd).st_size, digest_fd(fd))
    finally:
        os.close(fd)
    name = trimmed_name(entry.sha256_chunked)
    os.replace(tmp, ckpt / name)
    fsync_path(ckpt)
    return replace(manifest, files={name: entry}, written_sha256=manifest.layers_sha256, kept_layers=kept)


def _remove(path: Path) -> None:
    # A symbolic link to a directory goes as a link: what it points to is not the run's to delete.
    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink(missing_ok=True)


def _pid_of(name: str) -> int | None:
    parts = name[len(TMP_PREFIX):].split(".")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else None
