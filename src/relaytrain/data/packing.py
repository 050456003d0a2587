"""Packed instances (`data.instances: packed`): whole documents packed into `seq_len` tokens as
ai2-olmo-core's NumpyPackedFSLDataset packs them, so instance i here is its instance i.

OLMo-core's steps, each kept: the files are shuffled by Python's `random.Random(seed)` when a
source permutation seed is given (`source_permutation_seed`), then taken `group` at a time
(`source_group_size`) in that order; a group's files are one stream, its documents the spans
ending at each EOS (tokens after a file's last EOS belong to no document), a document longer
than `seq_len` truncated to its first `seq_len` tokens (`LongDocStrategy.truncate`, the default:
the rest is never trained on). The documents are sorted by decreasing length (numpy's default
argsort of the negated lengths, the same call, so ties fall the same way) and placed by
Optimized Best-Fit Decreasing: each into the open instance with the least room that still holds
it (the first opened among equals), else a new one. Instances are numbered group by group in the
order they were opened; an instance is its documents' tokens in placement order, padded with
the PAD id; its document lengths are OLMo-core's `doc_lens` (EOS-delimited spans of the padded
instance: the padding is one more span). OLMo-core finds "the least room" with a segment tree
over capacities 1..seq_len, which needs seq_len a power of two; here a sorted list of the
capacities open does the same search.

The packing is computed once per process when the split is opened (a pass over the EOS
positions of every file, a remote one read whole; OLMo-core caches it on disk in its work dir
and takes a remote file's documents from its metadata file instead, which matches the EOS
spans read here when every document ends in EOS, as Dolma's do): not yet cached here.
"""

from __future__ import annotations

import bisect
import random
from collections import defaultdict, deque
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from relaytrain.data.dataset import TokenDataset, TokenSplit
from relaytrain.data.token_arrays import ArraySplit
from relaytrain.errors import DataError

# A packed micro-batch's documents: (doc_lens int32 [rows, D], OLMo-core's, zero-padded; the
# tokens of each row that are not padding, int64 [rows])
Docs = tuple[torch.Tensor, torch.Tensor]


def permuted_files(n: int, seed: int | None) -> list[int]:
    """The order OLMo-core takes `n` source files in (`source_permutation_seed`)."""
    order = list(range(n))
    if seed is not None:
        random.Random(seed).shuffle(order)
    return order


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[list[list[int]], np.ndarray]:
    """(instances as lists of positions in the sorted order, the sort) of documents of
    `lengths` (each <= capacity), as OLMo-core's InstancePacker places them."""
    order = np.argsort(-1 * lengths.astype(np.int64))
    bins: list[list[int]] = []
    room: dict[int, deque[int]] = defaultdict(deque)  # free space -> bins, first opened first
    open_rooms: list[int] = []  # sorted free spaces that some bin has
    for doc, length in enumerate(lengths[order].tolist()):
        i = bisect.bisect_left(open_rooms, length)
        if i == len(open_rooms):
            bins.append([])
            b, free = len(bins) - 1, capacity
        else:
            free = open_rooms[i]
            b = room[free].popleft()
            if not room[free]:
                del open_rooms[i]
        bins[b].append(doc)
        left = free - length
        if left > 0:
            if not room[left]:
                bisect.insort(open_rooms, left)
            room[left].append(b)
    return bins, order


def document_lengths(tokens: np.ndarray, eos_id: int) -> np.ndarray:
    """OLMo-core's `get_document_lengths` (no BOS): EOS-delimited spans, a tail without an EOS
    one more span."""
    ends = np.flatnonzero(tokens == eos_id)
    if tokens.size and tokens[-1] != eos_id:
        ends = np.append(ends, tokens.size - 1)
    return np.diff(np.concatenate([[-1], ends])).astype(np.int64)


class PackedSplit:
    """A split's documents packed into instances of `seq_len` tokens, with the interface the
    loader, the controller and the audit use (`num_instances`, `instances`), plus
    `documents` (each instance's document lengths)."""

    def __init__(self, split: ArraySplit, seq_len: int, pad_id: int | None, group: int = 1,
                 permutation_seed: int | None = None) -> None:
        check_packable(split, seq_len, pad_id)
        assert pad_id is not None
        self.split, self.seq_len, self.pad_id = split, int(seq_len), int(pad_id)
        self.root, self.name, self.eos_id = split.root, split.name, split.eos_id
        self.num_tokens, self.num_documents = split.num_tokens, split.num_documents
        files = permuted_files(len(split.paths), permutation_seed)
        self._spans: list[np.ndarray] = []  # per instance: rows (file, start, length)
        for g in range(0, len(files), group):  # `data index` made every file end in EOS
            self._pack_group(files[g:g + group])

    def _pack_group(self, files: Sequence[int]) -> None:
        """Pack one source group and append its instances."""
        docs = [self._file_documents(f) for f in files]
        rows = np.concatenate(docs) if docs else np.zeros((0, 3), np.int64)
        if not rows.size:
            return
        bins, order = best_fit_decreasing(rows[:, 2], self.seq_len)
        rows = rows[order]
        self._spans.extend(rows[b] for b in bins)

    def _file_documents(self, f: int) -> np.ndarray:
        """int64 [documents, 3]: (file, start, length) of file f's documents, truncated."""
        tokens = np.asarray(self.split.read(f, 0, int(self.split.lengths[f])))
        ends = np.flatnonzero(tokens == self.eos_id) + 1
        starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        lengths = np.minimum(ends - starts, self.seq_len)
        return np.stack([np.full_like(starts, f), starts, lengths], axis=1)

    def _check_len(self, seq_len: int) -> None:
        if seq_len != self.seq_len:
            raise ValueError(f"packed for seq_len {self.seq_len}, asked for {seq_len}")

    def num_instances(self, seq_len: int) -> int:
        self._check_len(seq_len)
        return len(self._spans)

    def require_instances(self, seq_len: int) -> int:
        return self.num_instances(seq_len)

    def _ids(self, ids: Sequence[int] | np.ndarray) -> list[int]:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self._spans)):
            raise IndexError(f"instance ids must be in [0, {len(self._spans)}) for packed "
                             f"seq_len {self.seq_len}")
        return ids.tolist()

    def instances(self, ids: Sequence[int] | np.ndarray, seq_len: int) -> np.ndarray:
        """int64 [len(ids), seq_len]: each instance's documents, then PAD."""
        self._check_len(seq_len)
        ids = self._ids(ids)
        out = np.full((len(ids), seq_len), self.pad_id, dtype=np.int64)
        for row, i in enumerate(ids):
            at = 0
            for f, start, length in self._spans[i].tolist():
                out[row, at:at + length] = self.split.read(f, start, length)
                at += length
        return out

    def real_tokens(self, ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """int64 [len(ids)]: the tokens of each instance that are not padding."""
        return np.array([int(self._spans[i][:, 2].sum()) for i in self._ids(ids)], np.int64)


def check_packable(split: object, seq_len: int, pad_id: int | None) -> None:
    """Refuse, in one line, what OLMo-core could not pack."""
    if not isinstance(split, ArraySplit):
        raise DataError(f"data.instances packed packs OLMo-core token arrays, but "
                        f"{getattr(split, 'root', split)} was written by `data prepare`; index "
                        "its token files with `relaytrain data index` or use data.instances "
                        "concatenated")
    if seq_len < 1 or seq_len & (seq_len - 1):
        raise DataError(f"data.instances packed needs a power-of-two data.seq_len (OLMo-core's "
                        f"packer), got {seq_len}")
    if pad_id is None:
        raise DataError(f"{split.root}: index.json has no PAD id, which packed instances are "
                        "padded with; index with --tokenizer or --pad-id")



def micro_batch_documents(split: PackedSplit, ids: np.ndarray, tokens: np.ndarray) -> Docs:
    """The `Docs` of packed instances `ids` whose tokens are `tokens` (doc_lens zero-padded as
    OLMo-core's collator pads them)."""
    lens = [document_lengths(row, split.eos_id) for row in tokens]
    out = torch.zeros(len(lens), max(len(x) for x in lens), dtype=torch.int32)
    for row, x in enumerate(lens):
        out[row, :len(x)] = torch.from_numpy(x)
    return out, torch.from_numpy(split.real_tokens(ids))


def model_inputs(tokens: torch.Tensor, documents: Docs | None, whole: bool = False,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(inputs, next-token labels, document lengths of the inputs or None) of a micro-batch's
    tokens [rows, T]: inputs are T - 1 tokens, so each row's last span is one shorter; a label
    that is padding is ignored (-100), as OLMo-core's label mask ignores it. With `whole`,
    packed instances' inputs are all T tokens, the last one's label ignored (OLMo-core's
    `get_labels`): what a context-parallel split of the instance's `seq_len` tokens takes."""
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    if documents is None:
        return inputs, labels, None
    doc_lens, real = documents
    lens = doc_lens.clone()
    if whole:
        inputs, labels = tokens, F.pad(labels, (0, 1), value=-100)
    else:
        last = (lens > 0).sum(1) - 1
        lens[torch.arange(lens.shape[0]), last] -= 1
    pad = torch.arange(1, labels.shape[1] + 1, device=tokens.device)[None, :] >= \
        real.to(tokens.device)[:, None]
    return inputs, labels.masked_fill(pad, -100), lens


def train_split(dataset: TokenDataset, seq_len: int, packing: dict | None,
                ) -> TokenSplit | ArraySplit | PackedSplit:
    """The training split as instances: cut from the stream (`packing` None), or packed
    {"group": files packed together, "seed": their permutation's} (`RunConfig.packing`, which
    the ledger header records)."""
    split = dataset.split("train")
    if packing is None:
        return split
    return PackedSplit(split, seq_len, dataset.pad_id, packing["group"], packing["seed"])
