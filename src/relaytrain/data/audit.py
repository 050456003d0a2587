"""`relaytrain data audit RUN_DIR`: prove (or refute) that a run consumed its data exactly once.

The ledger records the ids each DP rank actually trained on; the audit recomputes the pure
order independently and checks, over the committed steps (the last record of a step wins after
a rollback):

- config: every (re)start used the same seed, data seed, global batch, seq_len and data;
- data: the data dir is the one the run trained on;
- no_gaps: every step 1..last is present;
- shards_disjoint: within a step, no instance is on two ranks (or twice on one);
- continuity: step k's ids, rank parts concatenated, are exactly pure global batch k-1 whatever
  dp was, so a replay or skip after a resume and a world-size-dependent order are caught;
- shards_complete: the union of the parts is the whole expected global batch;
- exactly_once: no instance twice in an epoch, and every epoch before the last is complete;
- heldout_documents: no document is in both splits (sha256 of the text);
- heldout_ngrams: sampled held-out 32-token windows are looked up in every training 32-gram
  (a vectorised rolling hash over the whole training stream, or evenly spaced chunks of it
  above `max_scan_tokens`), catching contamination that the document hashes do not;
- heldout_documents:NAME, heldout_ngrams:NAME: the same two for each named evaluation set
  (`eval.sets`, recorded in the ledger headers) against the training split.

Exit code 0 when every check passes, 1 when one fails, 2 for bad input.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from relaytrain.data.contamination import NGRAM, ngram_overlap
from relaytrain.data.dataset import TokenDataset
from relaytrain.data.eval_sets import open_eval_set
from relaytrain.data.ledger import LEDGER_FILE, read_ledger
from relaytrain.data.olmo_order import OlmoOrder, rank_positions
from relaytrain.data.order import Order
from relaytrain.data.packing import train_split
from relaytrain.errors import DataError

CHECKS = ("config", "data", "no_gaps", "shards_disjoint", "continuity", "shards_complete",
          "exactly_once", "heldout_documents", "heldout_ngrams")
ORDER_KEYS = ("seed", "data_seed", "global_batch", "seq_len", "n_instances", "fingerprint")
HEADER_KEYS = (*ORDER_KEYS, "micro_batch", "dp", "data_path")
SOURCE = -1  # an instance the run a continued run continues consumed (its first epoch's)
# Distinct documents share some 32-grams naturally (a few percent on the demo corpus, mostly
# generated codec tables and boilerplate: docs/MEASURED.md); a held-out set that holds (near)
# copies of training documents shows up as a large share, up to 100%.
MAX_OVERLAP = 0.2


@dataclass
class Finding:
    check: str
    message: str
    step: int | None = None
    instance: int | None = None


@dataclass
class CheckResult:
    name: str
    ok: bool
    detail: str
    finding: Finding | None = None


@dataclass
class AuditReport:
    run_dir: str
    data_path: str
    steps: int = 0
    instances: int = 0
    epochs: int = 0  # epochs touched
    complete_epochs: int = 0
    rollbacks: int = 0
    rolled_back_steps: int = 0
    resumes: int = 0
    resizes: int = 0
    torn_tail: bool = False
    origin: dict[str, Any] | None = None  # where step 0 came from (`init.from`; None: seed)
    ngram: dict[str, Any] = field(default_factory=dict)  # the run's own held-out split's
    eval_ngrams: dict[str, dict[str, Any]] = field(default_factory=dict)  # per named set
    checks: list[CheckResult] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def first_failure(self) -> Finding | None:
        """The earliest offending step (step-less failures, e.g. contamination, first)."""
        found = [c.finding for c in self.checks if not c.ok and c.finding]
        if not found:
            return None
        return min(found, key=lambda f: (-1 if f.step is None else f.step, _rank(f.check)))

    def to_json(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "checks"}
        first = self.first_failure
        d.update(ok=self.ok,
                 checks={"passed": sum(c.ok for c in self.checks),
                         "failed": sum(not c.ok for c in self.checks)},
                 results={c.name: {"ok": c.ok, "detail": c.detail} for c in self.checks},
                 first_failure=asdict(first) if first else None)
        return d


# ---- reading the ledger ----------------------------------------------------------------------

@dataclass
class _Segment:
    """The steps run under one header (a start, resume, recovery or resize)."""

    header: dict[str, Any]
    after_step: int  # the highest committed step when the header was written


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise DataError(f"{where}: {what}")


def _int_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool)
                                           for v in value)


@dataclass
class _Steps:
    committed: dict[int, tuple[dict[str, Any], _Segment]] = field(default_factory=dict)
    redone: list[int] = field(default_factory=list)  # recorded again with no rollback between


def _parse(records: list[dict[str, Any]], path: Path,
           report: AuditReport) -> tuple[list[_Segment], _Steps]:
    segments: list[_Segment] = []
    steps = _Steps()
    committed = steps.committed
    for lineno, rec in enumerate(records, 1):
        where = f"{path} record {lineno}"
        kind = rec.get("kind")
        if kind == "header":
            rec = {"data_seed": rec.get("seed"), **rec}  # before data.seed, the seed's order
            missing = [k for k in HEADER_KEYS if k not in rec]
            _need(not missing, where, f"header lacks {', '.join(missing)}")
            _need(all(isinstance(rec[k], int) and rec[k] >= (0 if "seed" in k else 1)
                      for k in HEADER_KEYS if k not in ("fingerprint", "data_path")),
                  where, "header values must be positive integers")
            segments.append(_Segment(rec, max(committed, default=0)))
        elif kind == "step":
            _need(bool(segments), where, "a step record before any header")
            _need(isinstance(rec.get("step"), int) and rec["step"] >= 1, where,
                  "step must be an integer >= 1")
            parts = rec.get("parts")
            _need(isinstance(parts, list) and all(_int_list(p) for p in parts), where,
                  "parts must be a list of lists of instance ids")
            if rec["step"] in committed:
                steps.redone.append(rec["step"])
            committed[rec["step"]] = (rec, segments[-1])
        elif kind == "rollback":
            discarded = rec.get("steps")
            _need(_int_list(discarded), where, "rollback steps must be a list of step numbers")
            for s in discarded:
                committed.pop(s, None)
            report.rollbacks += bool(discarded)
            report.rolled_back_steps += len(discarded)
        # other kinds are for other readers
    if not segments:
        raise DataError(f"{path}: no header record; not a ledger written by relaytrain train")
    report.resumes = len(segments) - 1
    report.resizes = sum(a.header["dp"] != b.header["dp"]
                         for a, b in zip(segments, segments[1:], strict=False))
    return segments, steps


# ---- the checks ------------------------------------------------------------------------------

class _Check:
    """Collects the findings of one check, keeping the earliest step's."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.finding: Finding | None = None
        self.count = 0

    def fail(self, message: str, step: int | None = None, instance: int | None = None) -> None:
        self.count += 1
        f = self.finding
        if f is None or (step is not None and (f.step is None or step < f.step)):
            self.finding = Finding(self.name, message, step, instance)

    def result(self, ok_detail: str) -> CheckResult:
        f = self.finding
        if f is None:
            return CheckResult(self.name, True, ok_detail)
        step = f"step {f.step}: " if f.step is not None else ""
        more = f" ({self.count} findings)" if self.count > 1 else ""
        return CheckResult(self.name, False, step + f.message + more, f)


def _context(seg: _Segment, segments: list[_Segment]) -> str:
    i = segments.index(seg)
    if i == 0:
        return f"dp={seg.header['dp']}, first start"
    prev = segments[i - 1].header["dp"]
    what = f"resize dp {prev}->{seg.header['dp']}" if prev != seg.header["dp"] else "resume"
    return f"dp={seg.header['dp']}, after the {what} at step {seg.after_step}"


def _check_config(segments: list[_Segment]) -> CheckResult:
    c = _Check("config")
    first = segments[0].header
    for seg in segments:
        h = seg.header
        changed = [k for k in (*ORDER_KEYS, "init", "packing") if h.get(k) != first.get(k)]
        if changed:
            k = changed[0]
            c.fail(f"the header of the restart there changed {k} from {first.get(k)!r} to "
                   f"{h.get(k)!r}", seg.after_step + 1)
        if h["global_batch"] % (h["dp"] * h["micro_batch"]):
            c.fail(f"the header there cannot split global batch {h['global_batch']} over "
                   f"dp={h['dp']} x micro_batch={h['micro_batch']}", seg.after_step + 1)
    start = ((first.get("init") or {}).get("trainer") or {}).get("step", 0)
    return c.result(f"{len(segments)} headers agree on seed, data seed {first['data_seed']}, "
                    f"global batch, seq_len and data; step {start} from "
                    f"{describe_origin(first.get('init'))}")
def describe_origin(origin: dict[str, Any] | None) -> str:
    """Where a run's step 0 came from, as the ledger header records it (`init.from`)."""
    if not origin:
        return "the seed"
    step = f" step {origin['step']}" if origin.get("step") is not None else ""
    trainer = origin.get("trainer") or {}
    carried = (f"; its trainer state: step {trainer.get('step')}, epoch {trainer.get('epoch')} "
               f"{trainer.get('tokens')} tokens in, global batch {trainer.get('batch')}"
               if trainer else "")
    return (f"init.from {origin.get('kind')} {origin.get('from')}{step} "
            f"({'+'.join(origin.get('took', []))}, {origin.get('digest')}{carried})")


def _check_data(first: dict[str, Any], ds: TokenDataset) -> CheckResult:
    c = _Check("data")
    if ds.fingerprint != first["fingerprint"]:
        c.fail(f"{ds.path} has fingerprint {ds.fingerprint[:12]}, the run trained on "
               f"{str(first['fingerprint'])[:12]}")
    n = train_split(ds, first["seq_len"], first.get("packing")).num_instances(first["seq_len"])
    if n != first["n_instances"]:
        c.fail(f"{ds.path} has {n} training instances at seq_len {first['seq_len']}, the run "
               f"had {first['n_instances']}")
    return c.result(f"fingerprint {ds.fingerprint[:12]} matches, {n} instances")


def _plus(offset: int) -> str:
    return f" + {offset}" if offset > 0 else f" - {-offset}" if offset else ""


def _describe_mismatch(k: int, got: np.ndarray, want: np.ndarray,
                       batch_of: dict[bytes, int], layout: _Layout) -> str:
    j, i = batch_of.get(np.sort(got).tobytes()), layout.index(k)
    if j is not None and j != i:
        return (f"holds global batch {j} (that of step {j + 1 - layout.offset}) instead of "
                f"{i}: {'a replay' if j < i else 'a skip ahead'}")
    if len(got) == len(want) and np.array_equal(np.sort(got), np.sort(want)):
        return f"holds global batch {i} in the wrong order (rank parts misplaced)"
    common = min(len(got), len(want))
    p = int(np.argmax(got[:common] != want[:common])) if common else 0
    differ = len(np.setxor1d(got, want))
    return (f"differs from pure global batch {i} in {differ} ids (position {p}: got "
            f"{got[p] if p < len(got) else '-'}, expected {want[p] if p < len(want) else '-'})")


def _missing(want: np.ndarray, got: np.ndarray) -> np.ndarray:
    """Ids of `want` that `got` holds fewer times (a batch straddling epochs may repeat one)."""
    wu, wc = np.unique(want, return_counts=True)
    gu, gc = np.unique(got, return_counts=True)
    if not gu.size:
        return wu
    idx = np.searchsorted(gu, wu).clip(max=gu.size - 1)
    have = np.where(gu[idx] == wu, gc[idx], 0)
    return wu[have < wc]


def _first_shared(keys: np.ndarray) -> tuple[int, int] | None:
    """Positions (a, b) of the first key that occurs twice."""
    order = np.argsort(keys, kind="stable")
    dup = np.flatnonzero(keys[order][1:] == keys[order][:-1])
    if not dup.size:
        return None
    return int(order[dup[0]]), int(order[dup[0] + 1])


class _Layout:
    """Where the run's pure order (header "order": relay or olmo-core) puts each instance."""

    def __init__(self, header: dict[str, Any]) -> None:
        seed, self.B, self.n = (header["data_seed"], header["global_batch"],
                                header["n_instances"])
        # a run continuing another's trainer state (init.trainer_state) starts at the source's
        # step, its first step on the global batch the source's data position gave
        trainer = (header.get("init") or {}).get("trainer") or {}
        self.start = int(trainer.get("step", 0))
        self.offset = int(trainer.get("batch", 0)) - self.start
        self.olmo = header.get("order", "relay") == "olmo-core"
        if self.olmo:
            self._olmo = OlmoOrder(seed, self.n, self.B)
            self.per_epoch = self._olmo.batches_per_epoch * self.B  # the tail is dropped
        else:
            self._relay = Order(seed, self.n)
            self.per_epoch = self.n

    def index(self, k: int) -> int:
        """The global batch step k trains on."""
        return k - 1 + self.offset

    def batch(self, k: int) -> np.ndarray:
        """The ids of step k's global batch, in order."""
        if self.olmo:
            return self._olmo.global_batch(self.index(k))[1]
        return self._relay.global_batch(self.B, self.index(k))[1]

    def parts(self, k: int, dp: int) -> np.ndarray:
        """Step k's ids as dp ranks hold them, rank parts concatenated."""
        ids = self.batch(k)
        if not self.olmo or dp < 1 or self.B % dp:
            return ids
        return np.concatenate([ids[rank_positions(self.B, r, dp)] for r in range(dp)])

    def epochs(self, k: int, size: int) -> np.ndarray:
        """The epoch of each of the `size` positions of step k."""
        if self.olmo:
            return np.full(size, self.index(k) // self._olmo.batches_per_epoch, dtype=np.int64)
        return (np.arange(size, dtype=np.int64) + self.index(k) * self.B) // self.n

    def last_epoch(self, last_step: int) -> int:
        return int(self.epochs(last_step, self.B)[-1]) if last_step > self.start else -1

    def end_step(self, epoch: int) -> int:
        """The step that completes `epoch`."""
        if self.olmo:
            return (epoch + 1) * self._olmo.batches_per_epoch - self.offset
        return ((epoch + 1) * self.n - 1) // self.B + 1 - self.offset

    def carried(self) -> tuple[int, np.ndarray]:
        """The epoch the run's first step is in and the instances of it that its source
        consumed before (none for a run of its own)."""
        first = self.index(self.start + 1)
        epoch = int(self.epochs(self.start + 1, 1)[0])
        done = first * self.B - epoch * self.per_epoch  # positions of the epoch before it
        if self.olmo:
            return epoch, self._olmo.permutation(epoch)[:done].astype(np.int64)
        return epoch, self._relay.permutation(epoch)[:done]

    def epoch_ids(self, epoch: int) -> np.ndarray:
        """The instances `epoch` uses."""
        if self.olmo:
            return self._olmo.permutation(epoch)[:self.per_epoch].astype(np.int64)
        return np.arange(self.n, dtype=np.int64)


class _EpochUse:
    """The step that first used each instance, per open epoch: catches a second use within an
    epoch and an epoch left incomplete."""

    def __init__(self, layout: _Layout, last_epoch: int) -> None:
        self.layout, self.last_epoch = layout, last_epoch
        self.check = _Check("exactly_once")
        # epoch -> step per instance (0: unused; SOURCE: by the run a continued run continues)
        self.used: dict[int, np.ndarray] = {}
        self.closed: set[int] = set()
        self.complete = 0
        self.first_epoch, before = layout.carried()
        if before.size and last_epoch >= self.first_epoch:
            self.used[self.first_epoch] = np.zeros(layout.n, dtype=np.int64)
            self.used[self.first_epoch][before] = SOURCE

    def close(self, e: int) -> None:
        self.closed.add(e)
        seen = self.used.pop(e, np.zeros(self.layout.n, dtype=np.int64))
        want = self.layout.epoch_ids(e)
        unused = want[seen[want] == 0]
        if not unused.size:
            self.complete += 1
        elif e < self.last_epoch:
            end = self.layout.end_step(e)
            self.check.fail(f"epoch {e} is incomplete: instance {int(unused[0])} never used by "
                            f"its last step {end} ({unused.size} of {want.size} unused)", end,
                            int(unused[0]))

    def add(self, k: int, got: np.ndarray, pos_epochs: np.ndarray) -> None:
        for e in [e for e in self.used if pos_epochs.size and e < pos_epochs[0]]:
            self.close(e)
        for e in np.unique(pos_epochs).tolist():
            ids = got[pos_epochs == e]
            ids = ids[(ids >= 0) & (ids < self.layout.n)]
            seen = self.used.setdefault(e, np.zeros(self.layout.n, dtype=np.int64))
            uniq, counts = np.unique(ids, return_counts=True)
            again = uniq[(seen[uniq] != 0) | (counts > 1)]
            if again.size:
                i = int(again[0])
                first = "the source's steps" if seen[i] == SOURCE else \
                    f"steps {int(seen[i]) or k}"
                self.check.fail(f"instance {i} used twice in epoch {e} ({first} and {k})", k, i)
            seen[ids] = np.where(seen[ids] == 0, k, seen[ids])

    def finish(self) -> None:
        for e in range(self.first_epoch, self.last_epoch + 1):
            if e not in self.closed:
                self.close(e)


def _check_shards(ctx: str, k: int, parts: list[np.ndarray], dp: int, layout: _Layout,
                  disjoint: _Check) -> np.ndarray:
    """The epoch of each recorded position; shard sizes, ranges and overlaps go to `disjoint`."""
    B, n = layout.B, layout.n
    got = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if len(parts) != dp or B % max(dp, 1) or any(len(p) != B // dp for p in parts):
        disjoint.fail(f"{ctx}: {len(parts)} parts of sizes {[len(p) for p in parts]}, "
                      f"expected {dp} parts of {B // max(dp, 1)}", k)
    bad = got[(got < 0) | (got >= n)]
    if bad.size:
        disjoint.fail(f"{ctx}: instance {int(bad[0])} is out of range [0, {n})", k, int(bad[0]))
    # a batch straddling epochs may hold an instance once per epoch, never twice in one
    pos_epochs = layout.epochs(k, got.size)
    shared = _first_shared(pos_epochs * n + got)
    if shared:
        ranks = np.repeat(np.arange(len(parts)), [len(p) for p in parts])
        a, b = (int(ranks[x]) for x in shared)
        where = f"twice on rank {a}" if a == b else f"on rank {a} and rank {b}"
        disjoint.fail(f"{ctx}: instance {int(got[shared[0]])} is {where}", k,
                      int(got[shared[0]]))
    return pos_epochs


def _check_steps(segments: list[_Segment], recorded: _Steps,
                 report: AuditReport) -> list[CheckResult]:
    committed = recorded.committed
    layout = _Layout(segments[0].header)
    gaps, disjoint, cont, complete = (_Check(name) for name in (
        "no_gaps", "shards_disjoint", "continuity", "shards_complete"))
    steps = sorted(committed)
    last = steps[-1] if steps else 0
    first = layout.start + 1
    for s in sorted(set(range(first, last + 1)) - set(steps)):
        gaps.fail(f"missing (steps {first}..{last} expected)", s)
    for s in recorded.redone:
        cont.fail("recorded twice with no rollback in between: the first run of the step was "
                  "never discarded", s)
    batch_of: dict[bytes, int] = {}  # built on the first mismatch, to name replays
    use = _EpochUse(layout, layout.last_epoch(last))
    for k in steps:
        rec, seg = committed[k]
        ctx = _context(seg, segments)
        parts = [np.asarray(p, dtype=np.int64) for p in rec["parts"]]
        got = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        want = layout.parts(k, rec.get("dp", len(parts)))
        if rec.get("batch", k - 1) != layout.index(k):
            cont.fail(f"{ctx}: the record says batch {rec['batch']}, expected "
                      f"{layout.index(k)}", k)
        pos_epochs = _check_shards(ctx, k, parts, rec.get("dp", len(parts)), layout, disjoint)
        if not np.array_equal(got, want):  # continuity against the pure order
            if not batch_of:
                batch_of.update((np.sort(layout.batch(s)).tobytes(), layout.index(s))
                                for s in steps)
            cont.fail(f"{ctx}: {_describe_mismatch(k, got, want, batch_of, layout)}", k,
                      int(want[0]) if want.size else None)
        lost = _missing(want, got)
        if lost.size:
            complete.fail(f"{ctx}: instance {int(lost[0])} of global batch {layout.index(k)} is "
                          "on no "
                          f"rank ({lost.size} missing)", k, int(lost[0]))
        use.add(k, got, pos_epochs)
    use.finish()
    report.steps = len(steps)
    report.instances = len(steps) * layout.B
    report.epochs = use.last_epoch + 1
    report.complete_epochs = use.complete
    return [
        gaps.result(f"steps {first}..{last} all present" if last else "no committed steps"),
        disjoint.result(f"{len(steps)} steps, dp shards disjoint"),
        cont.result(f"every step k holds pure global batch k-1{_plus(layout.offset)} across "
                    f"{report.resumes} "
                    f"resumes, {report.resizes} resizes"),
        complete.result("every global batch fully consumed"),
        use.check.result(f"{report.instances} instances, at most once per epoch; "
                         f"{use.complete} complete epochs"),
    ]


def _rank(check: str) -> int:
    """Where a check is reported: a named set's checks (`heldout_ngrams:c4`) with their kind."""
    return CHECKS.index(check.split(":")[0])


def _check_heldout_documents(ds: TokenDataset, held: TokenDataset, suffix: str = ""
                             ) -> CheckResult:
    c = _Check("heldout_documents" + suffix)
    if ds.kind != "prepared" or held.kind != "prepared":
        return c.result("not applicable: OLMo-core token arrays carry no document text (the "
                        "n-gram check covers contamination)")
    train = ds.doc_hashes("train")
    heldout = held.split("heldout").doc_digests()
    shared = [i for i, d in enumerate(heldout) if bytes(d).hex() in train]
    if shared:
        c.fail(f"{len(shared)} held-out documents are also training documents (first: held-out "
               f"document {shared[0]}, sha256 {bytes(heldout[shared[0]]).hex()[:12]})")
    return c.result(f"{len(train)} training and {len(heldout)} held-out documents disjoint")


def _check_heldout_ngrams(ds: TokenDataset, held: TokenDataset, max_overlap: float,
                          result: dict[str, Any], suffix: str = "") -> CheckResult:
    c = _Check("heldout_ngrams" + suffix)
    r = ngram_overlap(ds.split("train"), held.split("heldout"))
    result.update(r)
    if r["sampled"] == 0:
        return c.result(f"not checked: no held-out window of {NGRAM} tokens")
    detail = (f"{r['matched']} of {r['sampled']} sampled held-out {NGRAM}-grams occur in "
              f"training ({r['overlap']:.1%}, {r['train_coverage']:.0%} of the training stream "
              "scanned)")
    if r["overlap"] > max_overlap:
        m = r["first_match"]
        c.fail(f"{detail}, above {max_overlap:.1%}: e.g. held-out document "
               f"{m['heldout_document']} at token {m['heldout_offset']} = training token "
               f"{m['train_offset']}")
    return c.result(detail)


# ---- entry points ----------------------------------------------------------------------------

def _data_path(run_dir: Path, header: dict[str, Any], override: str | None) -> Path:
    if override:
        return Path(override)
    path = Path(header["data_path"])
    if not path.is_absolute() and not path.exists() and (run_dir / path).exists():
        path = run_dir / path
    if not path.exists():
        raise DataError(f"data dir {path} (named by the ledger header) does not exist; pass "
                        "--data DIR")
    return path


def audit(run_dir: str | Path, *, data_path: str | None = None,
          max_overlap: float = MAX_OVERLAP) -> AuditReport:
    """Audit a run directory; bad input raises DataError, findings go into the report."""
    run_dir = Path(run_dir)
    ledger = read_ledger(run_dir / LEDGER_FILE)
    report = AuditReport(str(run_dir), "", torn_tail=ledger.torn_tail)
    segments, recorded = _parse(ledger.records, run_dir / LEDGER_FILE, report)
    first = segments[0].header
    report.origin = first.get("init")
    ds = TokenDataset.open(_data_path(run_dir, first, data_path))
    report.data_path = str(ds.path)
    report.checks = [_check_config(segments), _check_data(first, ds),
                     *_check_steps(segments, recorded, report),
                     _check_heldout_documents(ds, ds),
                     _check_heldout_ngrams(ds, ds, max_overlap, report.ngram)]
    sets = {name: path for seg in segments for name, path in seg.header.get(
        "eval_sets", {}).items()}  # every set any (re)start evaluated
    for name, path in sets.items():
        held = open_eval_set(name, path)
        report.eval_ngrams[name] = {}
        report.checks += [_check_heldout_documents(ds, held, f":{name}"),
                          _check_heldout_ngrams(ds, held, max_overlap,
                                                report.eval_ngrams[name], f":{name}")]
    report.checks.sort(key=lambda c: _rank(c.name))
    return report

