"""Hostile inputs and faults, each generated here and run through the real CLI (click's runner on ``pmakit.cli:cli``
with its standalone main): one ``Error:`` line and no traceback, a non-zero exit, and the temporary tree exactly as
it was (inputs untouched, nothing that looks like a finished output, no ``.pmakit-old`` leftovers).

Each case builds a run of three small snapshots, damages it (or the options, or the output path, or the machine:
disk full, a held lock, an input changing during the merge) and names the fragments its error line must contain.
"""

from __future__ import annotations

import contextlib
import errno
import faulthandler
import hashlib
import json
import os
import struct
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner

from conftest import SRC, run_cli, state, write_snapshot
from pmakit.cli import cli
from pmakit.formats import safetensors_io, torch_io
from pmakit.guard import LOCK_SUFFIX
from pmakit.merge.output import partial_dir

STEPS = (100, 200, 300)


@dataclass
class Case:
    args: list[Any]
    fragments: tuple[str, ...]
    code: int = 1
    patches: list[tuple[Any, str, Any]] = field(default_factory=list)
    """(object, attribute, replacement) set for the run of the command only."""
    mutates_inputs: bool = False
    """The fault itself changes an input (a file truncated during the merge): only the output is checked."""
    hold: Callable[[], contextlib.AbstractContextManager[Any]] | None = None


CASES: dict[str, Callable[[Path], Case]] = {}


def case(fn: Callable[[Path], Case]) -> Callable[[Path], Case]:
    CASES[fn.__name__] = fn
    return fn


# --- helpers that build and damage files ------------------------------------------------------------------------


def snap(tmp: Path, i: int) -> Path:
    return tmp / "run" / f"step-{STEPS[i - 1]:06d}"


def weights_file(tmp: Path, i: int = 3) -> Path:
    return snap(tmp, i) / "model.safetensors"


def merge_args(tmp: Path, *extra: Any) -> list[Any]:
    return ["merge", tmp / "run", "--last", "3", "-o", tmp / "out", *extra]


def explicit_args(tmp: Path, *extra: Any) -> list[Any]:
    return ["merge", *(snap(tmp, i) for i in (1, 2, 3)), "-o", tmp / "out", *extra]


def split(file: Path) -> tuple[dict[str, Any], bytes]:
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_raw(file: Path, header: bytes | str, body: bytes = b"") -> None:
    header = header.encode() if isinstance(header, str) else header
    file.write_bytes(struct.pack("<Q", len(header)) + header + body)


def edit_header(file: Path, fn: Callable[[dict[str, Any]], None]) -> None:
    header, body = split(file)
    fn(header)
    write_raw(file, json.dumps(header), body)


def set_meta(tmp: Path, i: int, **fields: Any) -> None:
    meta = snap(tmp, i) / "pmakit.json"
    record = json.loads(meta.read_text())
    record.update(fields)
    meta.write_text(json.dumps(record))


def to_torch(tmp: Path, i: int, obj: Any = None) -> Path:
    """Replace snapshot i's weights by a ``model.pt`` (its own state dict unless ``obj`` is given)."""
    d = snap(tmp, i)
    (d / "model.safetensors").unlink()
    torch.save(state(i) if obj is None else obj, d / "model.pt")
    return d / "model.pt"


def flip_member_byte(file: Path) -> None:
    """Change one byte inside a stored zip member's data (its CRC no longer matches; torch does not notice)."""
    with zipfile.ZipFile(file) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 64)
    raw = bytearray(file.read_bytes())
    (name_len, extra_len) = struct.unpack("<HH", raw[info.header_offset + 26 : info.header_offset + 30])
    at = info.header_offset + 30 + name_len + extra_len + 7
    raw[at] ^= 0xFF
    file.write_bytes(bytes(raw))


def flip_body_byte(file: Path) -> None:
    raw = bytearray(file.read_bytes())
    raw[-9] ^= 0x40
    file.write_bytes(bytes(raw))


def base_merge(tmp: Path, name: str, *extra: Any) -> Path:
    """A real previous merge of the two oldest snapshots (for --from-previous cases)."""
    r = CliRunner().invoke(
        cli,
        list(
            map(str, ["merge", tmp / "run", "--last", "2", "--until", "2000", "-o", tmp / name, "-q", *extra])
        ),
    )
    assert r.exit_code == 0, r.output
    return tmp / name


# --- safetensors files -------------------------------------------------------------------------------------------


@case
def st_shorter_than_length_field(tmp: Path) -> Case:
    weights_file(tmp).write_bytes(b"abc")
    return Case(merge_args(tmp), ("step-000300", "shorter than its 8-byte header"))


@case
def st_header_length_beyond_file(tmp: Path) -> Case:
    weights_file(tmp).write_bytes(struct.pack("<Q", 10**12) + b"{}")
    return Case(merge_args(tmp), ("step-000300", "header length"))


@case
def st_header_not_json(tmp: Path) -> Case:
    write_raw(weights_file(tmp), "{abc: 1}")
    return Case(merge_args(tmp), ("step-000300", "corrupt safetensors header"))


@case
def st_header_json_list(tmp: Path) -> Case:
    write_raw(weights_file(tmp), "[1, 2]")
    return Case(merge_args(tmp), ("step-000300", "not a JSON object"))


@case
def st_header_nested_too_deep(tmp: Path) -> Case:
    write_raw(weights_file(tmp), "[" * 200_000 + "]" * 200_000)
    return Case(merge_args(tmp), ("step-000300", "corrupt safetensors header"))


@case
def st_unknown_dtype(tmp: Path) -> Case:
    edit_header(weights_file(tmp), lambda h: h["head.weight"].update(dtype="Q9"))
    return Case(merge_args(tmp), ("step-000300", "head.weight", "bad header entry"))


@case
def st_shape_not_numbers(tmp: Path) -> Case:
    edit_header(weights_file(tmp), lambda h: h["head.weight"].update(shape=["a", 16]))
    return Case(merge_args(tmp), ("head.weight", "bad header entry"))


@case
def st_shape_disagrees_with_length(tmp: Path) -> Case:
    edit_header(weights_file(tmp), lambda h: h["head.weight"].update(shape=[64, 15]))
    return Case(merge_args(tmp), ("head.weight", "wrong byte length"))


@case
def st_offsets_beyond_file(tmp: Path) -> Case:
    def move(h: dict[str, Any]) -> None:
        b, e = h["head.weight"]["data_offsets"]
        h["head.weight"]["data_offsets"] = [b + 10**6, e + 10**6]

    edit_header(weights_file(tmp), move)
    return Case(merge_args(tmp), ("head.weight", "outside the file"))


@case
def st_negative_offset(tmp: Path) -> Case:
    def move(h: dict[str, Any]) -> None:
        b, e = h["layers.0.norm.weight"]["data_offsets"]
        h["layers.0.norm.weight"]["data_offsets"] = [-(e - b), 0]

    edit_header(weights_file(tmp), move)
    return Case(merge_args(tmp), ("layers.0.norm.weight", "outside the file"))


@case
def st_truncated_body(tmp: Path) -> Case:
    file = weights_file(tmp)
    file.write_bytes(file.read_bytes()[:-100])
    return Case(merge_args(tmp), ("step-000300", "truncated or corrupt"))


@case
def st_overlapping_offsets(tmp: Path) -> Case:  # issue 13, defect 4: was a wrong tensor, exit 0
    def overlap(h: dict[str, Any]) -> None:
        h["layers.1.attn.weight"]["data_offsets"] = h["layers.0.attn.weight"]["data_offsets"]

    edit_header(weights_file(tmp), overlap)
    return Case(merge_args(tmp), ("step-000300", "invalid data_offsets"))


@case
def st_gap_between_tensors(tmp: Path) -> Case:
    def gap(h: dict[str, Any]) -> None:
        b, e = h["step_counter"]["data_offsets"]
        h["step_counter"]["data_offsets"] = [b + 8, e + 8]

    file = weights_file(tmp)
    edit_header(file, gap)
    file.write_bytes(file.read_bytes() + bytes(8))
    return Case(merge_args(tmp), ("step_counter", "invalid data_offsets"))


@case
def st_duplicate_header_key(tmp: Path) -> Case:  # issue 13, defect 4
    file = weights_file(tmp)
    header, body = split(file)
    text = (
        json.dumps(header)[:-1]
        + ', "layers.1.attn.weight": '
        + json.dumps(header["layers.0.attn.weight"])
        + "}"
    )
    write_raw(file, text, body)
    return Case(merge_args(tmp), ("step-000300", "layers.1.attn.weight", "appears twice"))


# --- shard indexes -----------------------------------------------------------------------------------------------


def write_index(tmp: Path, text: str) -> None:
    (snap(tmp, 3) / safetensors_io.INDEX_FILE).write_text(text)


@case
def index_not_json(tmp: Path) -> Case:
    write_index(tmp, "{weight_map")
    return Case(merge_args(tmp), ("model.safetensors.index.json", "unreadable index"))


@case
def index_without_weight_map(tmp: Path) -> Case:
    write_index(tmp, '{"metadata": {}}')
    return Case(merge_args(tmp), ("unreadable index",))


@case
def index_names_missing_shard(tmp: Path) -> Case:
    write_index(tmp, json.dumps({"weight_map": {"head.weight": "model-00001-of-00002.safetensors"}}))
    return Case(merge_args(tmp), ("model-00001-of-00002.safetensors", "missing"))


@case
def index_path_climbs_out(tmp: Path) -> Case:
    write_index(tmp, json.dumps({"weight_map": {"head.weight": "../step-000200/model.safetensors"}}))
    return Case(merge_args(tmp), ("outside the snapshot directory",))


@case
def index_absolute_path(tmp: Path) -> Case:
    write_index(tmp, json.dumps({"weight_map": {"head.weight": str(weights_file(tmp, 1))}}))
    return Case(merge_args(tmp), ("outside the snapshot directory",))


@case
def two_weight_files_without_index(tmp: Path) -> Case:
    weights_file(tmp).rename(snap(tmp, 3) / "a.safetensors")
    safetensors_io.save_file(state(3), snap(tmp, 3) / "b.safetensors")
    return Case(merge_args(tmp), ("2 .safetensors files", "no model.safetensors.index.json"))


# --- snapshot metadata (named one by one: an incomplete snapshot named explicitly is an error) -----------------


@case
def meta_tokens_true(tmp: Path) -> Case:  # issue 13, defect 9: read as 1 and written to the manifest as true
    set_meta(tmp, 3, tokens=True)
    return Case(explicit_args(tmp), ("step-000300", "'tokens' must be a non-negative integer", "true"))


@case
def meta_tokens_negative(tmp: Path) -> Case:
    set_meta(tmp, 3, tokens=-5)
    return Case(explicit_args(tmp), ("'tokens' must be a non-negative integer", "-5"))


@case
def meta_tokens_string(tmp: Path) -> Case:
    set_meta(tmp, 3, tokens="3000")
    return Case(explicit_args(tmp), ("'tokens' must be a non-negative integer",))


@case
def meta_tokens_fraction(tmp: Path) -> Case:
    set_meta(tmp, 3, tokens=2.5)
    return Case(explicit_args(tmp), ("'tokens' must be a non-negative integer", "2.5"))


@case
def meta_tokens_missing(tmp: Path) -> Case:
    meta = snap(tmp, 3) / "pmakit.json"
    meta.write_text(json.dumps({"step": 300}))
    return Case(explicit_args(tmp), ("'tokens' is missing",))


@case
def meta_step_true(tmp: Path) -> Case:
    set_meta(tmp, 3, step=True)
    return Case(explicit_args(tmp), ("'step' must be a non-negative integer",))


@case
def meta_not_json(tmp: Path) -> Case:
    (snap(tmp, 3) / "pmakit.json").write_text('{"tokens": 30')
    return Case(explicit_args(tmp), ("pmakit.json", "unreadable"))


@case
def meta_json_list(tmp: Path) -> Case:
    (snap(tmp, 3) / "pmakit.json").write_text("[3000]")
    return Case(explicit_args(tmp), ("pmakit.json", "expected a JSON object"))


@case
def meta_two_snapshots_same_tokens(tmp: Path) -> Case:
    set_meta(tmp, 3, tokens=2000)
    return Case(merge_args(tmp), ("two snapshots at 2000 tokens",))


@case
def meta_missing_in_named_snapshot(tmp: Path) -> Case:
    (snap(tmp, 3) / "pmakit.json").unlink()
    return Case(explicit_args(tmp), ("step-000300", "token count is unknown"))


# --- options -----------------------------------------------------------------------------------------------------


@case
def opt_tokens_per_step_negative(tmp: Path) -> Case:  # issue 13, defect 9: gave negative tokens
    return Case(merge_args(tmp, "--tokens-per-step", "-5"), ("--tokens-per-step",), code=2)


@case
def opt_exclude_names_nothing(tmp: Path) -> Case:  # issue 13, defect 9: silently ignored
    return Case(merge_args(tmp, "--exclude", tmp / "nope"), ("--exclude", "nope", "names none"))


@case
def opt_weights_overflow(tmp: Path) -> Case:  # issue 13, defect 9: OverflowError traceback
    return Case(merge_args(tmp, "--weights", "1e308,1e308,1e308"), ("--weights", "overflows"))


@case
def opt_weights_nan(tmp: Path) -> Case:
    return Case(merge_args(tmp, "--weights", "nan,1,1"), ("--weights must be finite",))


@case
def opt_weights_count(tmp: Path) -> Case:
    return Case(merge_args(tmp, "--weights", "1,2"), ("2 weights for 3",))


@case
def opt_weights_zero_sum(tmp: Path) -> Case:
    return Case(merge_args(tmp, "--weights", "1,-1,0"), ("positive sum",))


@case
def opt_weights_not_numbers(tmp: Path) -> Case:
    return Case(merge_args(tmp, "--weights", "a,b,c"), ("comma-separated numbers",), code=2)


@case
def opt_last_more_than_exist(tmp: Path) -> Case:
    return Case(["merge", tmp / "run", "--last", "10", "-o", tmp / "out"], ("--last 10", "only 3 exist"))


@case
def opt_every_unreadable(tmp: Path) -> Case:
    return Case(merge_args(tmp, "--every", "4X"), ("cannot read token count",), code=2)


@case
def opt_unknown_method(tmp: Path) -> Case:
    return Case(merge_args(tmp, "--method", "lawa"), ("--method",), code=2)


@case
def opt_unknown_dtype(tmp: Path) -> Case:
    return Case(merge_args(tmp, "--dtype", "int8"), ("--dtype",), code=2)


@case
def opt_shard_size_unreadable(tmp: Path) -> Case:
    return Case(merge_args(tmp, "--max-shard-size", "lots"), ("--max-shard-size",), code=2)


@case
def opt_missing_input(tmp: Path) -> Case:
    return Case(["merge", tmp / "nope", "-o", tmp / "out"], ("no such snapshot",))


# --- torch files -------------------------------------------------------------------------------------------------


class _Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (print, ("code ran while loading",))


@case
def pt_pickle_runs_code(tmp: Path) -> Case:
    to_torch(tmp, 3, {**state(3), "evil": _Boom()})
    return Case(merge_args(tmp), ("model.pt", "refused", "weights_only"))


@case
def pt_member_crc_wrong(tmp: Path) -> Case:  # issue 13, defect 7: merged silently
    flip_member_byte(to_torch(tmp, 3))
    return Case(merge_args(tmp), ("model.pt", "CRC"))


@case
def pt_truncated(tmp: Path) -> Case:
    file = to_torch(tmp, 3)
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    return Case(merge_args(tmp), ("model.pt", "corrupt"))


@case
def pt_garbage(tmp: Path) -> Case:
    to_torch(tmp, 3).write_bytes(os.urandom(4096))
    return Case(merge_args(tmp), ("model.pt",))


@case
def pt_not_a_state_dict(tmp: Path) -> Case:
    to_torch(tmp, 3, [torch.zeros(3)])
    return Case(merge_args(tmp), ("model.pt", "expected a state dict"))


# --- weights that cannot be merged -----------------------------------------------------------------------------


def rewrite(
    tmp: Path, i: int, edit: Callable[[dict[str, torch.Tensor]], None], dtype: torch.dtype = torch.bfloat16
) -> None:
    tensors = state(i, dtype)
    edit(tensors)
    write_snapshot(snap(tmp, i), tensors, step=STEPS[i - 1], tokens=STEPS[i - 1] * 10)


@case
def content_nan(tmp: Path) -> Case:
    rewrite(tmp, 2, lambda t: t["embed.weight"].view(-1)[5].fill_(float("nan")))
    return Case(merge_args(tmp), ("NaN", "embed.weight", "step-000200"))


@case
def content_inf(tmp: Path) -> Case:
    rewrite(tmp, 2, lambda t: t["head.weight"].view(-1)[0].fill_(float("inf")))
    return Case(merge_args(tmp), ("NaN/Inf", "head.weight"))


@case
def content_shape_mismatch(tmp: Path) -> Case:
    rewrite(tmp, 2, lambda t: t.update({"head.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}))
    return Case(merge_args(tmp), ("do not match", "head.weight"))


@case
def content_missing_tensor(tmp: Path) -> Case:
    rewrite(tmp, 2, lambda t: t.pop("head.weight"))
    return Case(merge_args(tmp), ("head.weight",))


@case
def content_fp16_overflow(tmp: Path) -> Case:  # issue 13, defect 6: Inf written silently
    for i in (1, 2, 3):
        rewrite(tmp, i, lambda t: t["embed.weight"].view(-1)[3].fill_(1e6), torch.float32)
    return Case(merge_args(tmp, "--dtype", "fp16"), ("embed.weight", "range of float16"))


# --- outputs that --force must not replace (issue 13, defects 2 and 10) -----------------------------------------


@case
def out_is_the_run(tmp: Path) -> Case:  # deleted the input snapshots
    return Case(["merge", tmp / "run", "--last", "3", "-o", tmp / "run", "--force"], ("contains the input",))


@case
def out_is_an_input(tmp: Path) -> Case:  # replaced an input
    return Case(
        ["merge", tmp / "run", "--last", "3", "-o", snap(tmp, 3), "--force"], ("is or contains the input",)
    )


@case
def out_inside_an_input(tmp: Path) -> Case:
    return Case(["merge", tmp / "run", "--last", "3", "-o", snap(tmp, 3) / "merged"], ("inside the input",))


@case
def out_is_a_file(tmp: Path) -> Case:
    (tmp / "notes.txt").write_text("keep me")
    return Case(
        ["merge", tmp / "run", "--last", "3", "-o", tmp / "notes.txt", "--force"], ("not a directory",)
    )


@case
def out_is_a_symlink_like_dev_null(tmp: Path) -> Case:  # -o /dev/null --force became a directory
    (tmp / "device").write_text("")
    (tmp / "null").symlink_to(tmp / "device")
    return Case(["merge", tmp / "run", "--last", "3", "-o", tmp / "null", "--force"], ("not a directory",))


@case
def out_is_a_symlink_to_a_dir(tmp: Path) -> Case:
    (tmp / "elsewhere").mkdir()
    (tmp / "elsewhere" / "data.txt").write_text("keep me")
    (tmp / "link").symlink_to(tmp / "elsewhere")
    return Case(["merge", tmp / "run", "--last", "3", "-o", tmp / "link", "--force"], ("not a directory",))


@case
def out_is_a_foreign_directory(tmp: Path) -> Case:
    (tmp / "home").mkdir()
    (tmp / "home" / "thesis.tex").write_text("keep me")
    return Case(["merge", tmp / "run", "--last", "3", "-o", tmp / "home", "--force"], ("did not write it",))


@case
def out_exists_without_force(tmp: Path) -> Case:
    base_merge(tmp, "out")
    return Case(merge_args(tmp), ("exists", "--force"))


# --- incremental updates ------------------------------------------------------------------------------------------


@case
def previous_merge_edited(tmp: Path) -> Case:  # issue 13, defect 5: a wrong incremental merge, exit 0
    prev = base_merge(tmp, "prev", "--dtype", "fp32")
    flip_body_byte(prev / "model.safetensors")
    return Case(
        ["merge", tmp / "run", "--last", "2", "-o", tmp / "out", "--from-previous", prev],
        ("sha256", "edited"),
    )


@case
def previous_fp32_sums_edited(tmp: Path) -> Case:
    prev = base_merge(tmp, "prev", "--dtype", "bf16", "--keep-fp32")
    flip_body_byte(prev / "pmakit-fp32" / "model.safetensors")
    return Case(
        ["merge", tmp / "run", "--last", "2", "-o", tmp / "out", "--from-previous", prev],
        ("pmakit-fp32", "sha256"),
    )


@case
def previous_is_not_a_merge(tmp: Path) -> Case:
    return Case(
        ["merge", tmp / "run", "--last", "2", "-o", tmp / "out", "--from-previous", snap(tmp, 1)],
        ("not a pmakit merge",),
    )


# --- faults while merging ---------------------------------------------------------------------------------------


def _on_first_read(reader_cls: Any, fault: Callable[[Path], None]) -> tuple[Any, str, Any]:
    original = reader_cls.read
    done: list[bool] = []

    def read(self: Any, name: str, start: int, stop: int, out: Any = None) -> Any:
        if not done and self.path.name == "step-000300":
            done.append(True)
            fault(self.path)
        return original(self, name, start, stop, out)

    return (reader_cls, "read", read)


def _truncate(path: Path) -> None:
    file = path / "model.safetensors" if (path / "model.safetensors").exists() else path / "model.pt"
    os.truncate(file, file.stat().st_size // 2)


@case
def input_truncated_while_merged(tmp: Path) -> Case:  # issue 13, defect 8: SIGBUS, rc 135, no message
    return Case(
        merge_args(tmp),
        ("step-000300", "truncated while being merged"),
        patches=[_on_first_read(safetensors_io.SafetensorsReader, _truncate)],
        mutates_inputs=True,
    )


@case
def input_overwritten_while_merged(tmp: Path) -> Case:  # issue 13, defect 8: matched neither version, exit 0
    def overwrite(path: Path) -> None:
        file = path / "model.safetensors"
        with open(file, "r+b") as f:  # in place, same size
            f.seek(-64, os.SEEK_END)
            f.write(bytes(64))
        os.utime(file, ns=(0, 10**18))

    return Case(
        merge_args(tmp),
        ("step-000300", "changed while being merged"),
        patches=[_on_first_read(safetensors_io.SafetensorsReader, overwrite)],
        mutates_inputs=True,
    )


@case
def pt_input_truncated_while_merged(tmp: Path) -> Case:
    to_torch(tmp, 3)
    return Case(
        merge_args(tmp),
        ("model.pt", "while being merged"),
        patches=[_on_first_read(torch_io.TorchReader, _truncate)],
        mutates_inputs=True,
    )


@case
def output_locked_by_another_merge(tmp: Path) -> Case:  # issue 13, defect 1 (the lock; races in test_faults)
    @contextlib.contextmanager
    def hold() -> Iterator[None]:
        import fcntl

        fd = os.open(tmp / f".out{LOCK_SUFFIX}", os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            os.close(fd)

    return Case(merge_args(tmp), ("another pmakit merge is writing",), hold=hold)


@case
def disk_too_small_for_fp32_sums(tmp: Path) -> Case:  # issue 13, defect 3: the check counted bf16 bytes only
    import shutil

    import pmakit.merge

    real = shutil.disk_usage

    def usage(path: Any) -> Any:
        u = real(path)
        return type(u)(u.total, u.used, 8000)  # the bf16 output (~5 KB) fits, with its fp32 sums (~15 KB) not

    return Case(
        merge_args(tmp, "--dtype", "bf16", "--keep-fp32"),
        ("not enough disk space",),
        patches=[(pmakit.merge.output.shutil, "disk_usage", usage)],
    )


def _enospc_on(method: str, call: int) -> tuple[Any, str, Any]:
    original = getattr(safetensors_io.ShardWriter, method)
    calls: list[int] = []

    def fail(self: Any, *args: Any) -> Any:
        calls.append(1)
        if len(calls) == call:
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, *args)

    return (safetensors_io.ShardWriter, method, fail)


@case
def disk_full_at_last_close_keep_fp32(tmp: Path) -> Case:  # issue 13, defect 3: deadlocked in finish()
    return Case(
        merge_args(tmp, "--dtype", "bf16", "--keep-fp32"), ("disk full",), patches=[_enospc_on("finish", 1)]
    )


@case
def disk_full_mid_write(tmp: Path) -> Case:
    return Case(
        merge_args(tmp, "--dtype", "bf16", "--keep-fp32"), ("disk full",), patches=[_enospc_on("write", 3)]
    )


@case
def inspect_nothing_mergeable(tmp: Path) -> Case:  # issue 13, defect 12: exit 0
    (tmp / "empty").mkdir()
    (tmp / "empty" / "notes.txt").write_text("no snapshots here")
    return Case(["inspect", tmp / "empty"], ("no complete snapshots",))


# --- trainers' layouts: OLMo-core save folders (DCP model_and_optim/ + train/rank0.pt), plain DCP --------------


def olmo_run(tmp: Path) -> list[Path]:
    """Three OLMo-core-shaped checkpoints (DCP written by torch.distributed.checkpoint, the trainer state by
    torch.save); the real OLMo-core Trainer writes the same files (tests/layouts/test_olmo_core.py)."""
    from pmakit.formats import dcp_io

    paths = []
    for i, step in enumerate(STEPS, 1):
        ck = tmp / "olmo" / f"step{step}"
        tensors = {k: v for k, v in state(i).items() if v.is_floating_point()}
        dcp_io.save({"model": tensors}, ck / "model_and_optim", fsync=False)
        (ck / "train").mkdir()
        torch.save({"global_step": step, "global_train_tokens_seen": step * 10}, ck / "train" / "rank0.pt")
        (ck / ".metadata.json").write_text("{}")
        paths.append(ck)
    return paths


def olmo_args(tmp: Path, paths: list[Path]) -> list[Any]:
    return ["merge", *paths, "-o", tmp / "out"]


@case
def olmo_truncated_distcp(tmp: Path) -> Case:
    paths = olmo_run(tmp)
    distcp = next((paths[2] / "model_and_optim").glob("*.distcp"))
    os.truncate(distcp, distcp.stat().st_size // 2)
    return Case(olmo_args(tmp, paths), (".distcp", "truncated"))


@case
def olmo_missing_dcp_metadata(tmp: Path) -> Case:
    paths = olmo_run(tmp)
    (paths[2] / "model_and_optim" / ".metadata").unlink()
    return Case(olmo_args(tmp, paths), ("step300", "model_and_optim/.metadata"))


@case
def olmo_save_not_finished(tmp: Path) -> Case:
    paths = olmo_run(tmp)
    (paths[2] / ".metadata.json").unlink()
    return Case(olmo_args(tmp, paths), ("step300", "did not finish"))


@case
def olmo_train_state_foreign_pickle(tmp: Path) -> Case:
    paths = olmo_run(tmp)
    torch.save(
        {"global_step": 300, "global_train_tokens_seen": 3000, "x": _Boom()}, paths[2] / "train" / "rank0.pt"
    )
    return Case(olmo_args(tmp, paths), ("rank0.pt", "refused"))


@case
def olmo_tokens_true(tmp: Path) -> Case:
    paths = olmo_run(tmp)
    torch.save({"global_step": 300, "global_train_tokens_seen": True}, paths[2] / "train" / "rank0.pt")
    return Case(olmo_args(tmp, paths), ("rank0.pt", "must be a non-negative integer"))


@case
def dcp_metadata_runs_code(tmp: Path) -> Case:
    import pickle

    paths = olmo_run(tmp)
    (paths[2] / "model_and_optim" / ".metadata").write_bytes(pickle.dumps(_Boom()))
    return Case(olmo_args(tmp, paths), ("refused to unpickle",))


@case
def dcp_distcp_truncated_while_merged(tmp: Path) -> Case:
    from pmakit.formats.dcp_io import DCPReader

    paths = olmo_run(tmp)
    original = DCPReader.read
    done: list[bool] = []

    def read(self: Any, name: str, start: int, stop: int, out: Any = None) -> Any:
        if not done and self.path.parent.name == "step300":
            done.append(True)
            distcp = next(self.path.glob("*.distcp"))
            os.truncate(distcp, distcp.stat().st_size // 2)
        return original(self, name, start, stop, out)

    return Case(
        olmo_args(tmp, paths),
        (".distcp", "truncated"),
        patches=[(DCPReader, "read", read)],
        mutates_inputs=True,
    )


# --- the harness -------------------------------------------------------------------------------------------------


def tree_digest(root: Path) -> dict[str, str]:
    """Every path under ``root`` with its content hash or link target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def build_run(tmp: Path) -> None:
    for i, step in enumerate(STEPS, 1):
        write_snapshot(snap(tmp, i), state(i), step=step, tokens=step * 10)


def invoke(args: list[Any], timeout: float = 1800) -> Any:
    """The real CLI in this process; a hang dumps the stacks and kills the test run instead of waiting forever."""
    faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        return CliRunner().invoke(cli, [str(a) for a in args])
    finally:
        faulthandler.cancel_dump_traceback_later()


def assert_refused(result: Any, case: Case) -> None:
    err = result.stderr
    assert result.exit_code == case.code, (result.exit_code, result.output, result.exception)
    assert isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output, result.output
    lines = err.rstrip().splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("Error: ")]
    # One error line, last; a list of differences may follow it indented (the snapshots that do not match).
    assert len(errors) == 1 and all(line.startswith("  ") for line in lines[errors[0] + 1 :]), err
    message = " ".join(lines[errors[0] :])
    for fragment in case.fragments:
        assert fragment in message, (fragment, message)


@pytest.mark.parametrize("name", sorted(CASES))
def test_refused_cleanly(name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    build_run(tmp_path)
    c = CASES[name](tmp_path)
    for obj, attr, value in c.patches:
        monkeypatch.setattr(obj, attr, value)
    with c.hold() if c.hold else contextlib.nullcontext():
        before = tree_digest(tmp_path)
        result = invoke(c.args)
        after = tree_digest(tmp_path)
    monkeypatch.undo()
    assert_refused(result, c)
    if c.mutates_inputs:  # the fault changed an input on purpose: nothing else may have appeared or changed
        changed = {k for k in before.keys() | after.keys() if before.get(k) != after.get(k)}
        assert all(
            k.startswith(("run/step-000300/model.", "olmo/step300/model_and_optim/")) for k in changed
        ), changed
    else:
        assert after == before


def test_corpus_size_and_docs_figure() -> None:
    """docs/reliability.md's figure comes from here."""
    assert len(CASES) >= 40
    page = (SRC.parent / "docs" / "reliability.md").read_text()
    assert f"{len(CASES)} hostile inputs and faults" in page, len(CASES)


# --- what is not a refusal ----------------------------------------------------------------------------------------


def test_same_command_continues_a_killed_merge(tmp_path: Path) -> None:  # issue 13, defect 13
    shapes = {f"layers.{i}.weight": (64, 64) for i in range(6)}
    for i, step in enumerate(STEPS, 1):
        write_snapshot(snap(tmp_path, i), state(i, torch.float32, shapes), step=step, tokens=step * 10)
    cmd = ["merge", tmp_path / "run", "--last", "3", "-o", tmp_path / "out", "--max-shard-size", "20KB"]
    killed = run_cli(*cmd, env={"PMAKIT_TEST_KILL": "after-shard:2"})
    assert killed.returncode == -9
    again = run_cli(*cmd)
    assert again.returncode == 0, again.stderr
    assert "continuing the interrupted merge" in again.stderr
    reference = run_cli(*cmd[:4], "-o", tmp_path / "ref", *cmd[6:])
    assert reference.returncode == 0, reference.stderr
    files = sorted(f.name for f in (tmp_path / "ref").glob("*.safetensors"))
    assert len(files) > 2
    for f in files:
        assert (tmp_path / "out" / f).read_bytes() == (tmp_path / "ref" / f).read_bytes()
    # --force starts over instead.
    assert run_cli(*cmd, "--force", env={"PMAKIT_TEST_KILL": "after-shard:1"}).returncode == -9
    assert partial_dir(tmp_path / "out").is_dir()  # an interrupted merge that --force must not continue
    fresh = run_cli(*cmd, "--force")
    assert fresh.returncode == 0 and "continuing" not in fresh.stderr


def test_force_over_a_merge_leaves_nothing_behind(tmp_path: Path) -> None:  # issue 13, defect 10
    build_run(tmp_path)
    base_merge(tmp_path, "out")
    r = invoke(merge_args(tmp_path, "--force", "-q"))
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "run"]


def test_warnings_that_are_not_errors(tmp_path: Path) -> None:  # issue 13, defect 9: no warning before
    build_run(tmp_path)
    set_meta(tmp_path, 1, step=900)  # step order disagrees with token order
    r = invoke(merge_args(tmp_path, "--weights", "-0.5,1,1", "-q"))
    assert r.exit_code == 0, r.output
    assert "step and token order disagree" in r.stderr
    assert "negative weights" in r.stderr


def test_tokens_true_not_written_as_true(tmp_path: Path) -> None:
    """A run-directory merge skips the snapshot with ``tokens: true`` (with a warning) rather than reading 1."""
    build_run(tmp_path)
    set_meta(tmp_path, 1, tokens=True)
    r = invoke(["merge", tmp_path / "run", "--last", "2", "-o", tmp_path / "out", "-q"])
    assert r.exit_code == 0, r.output
    assert "must be a non-negative integer" in r.stderr
    manifest = json.loads((tmp_path / "out" / "pmakit-merge.json").read_text())
    assert [i["tokens"] for i in manifest["inputs"]] == [2000, 3000]
