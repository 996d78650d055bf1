"""Structural mutators over real artifacts, driven by a seeded ``random.Random``: a mutation is a plain record
(mutator, target file, argument) that ``apply`` turns into the same bytes every time, so a crash is reproduced and
minimised from its record alone and kept as a regression case in ``corpus.py``.

Mutators know the formats they mutate: JSON (manifest, meta.json, trainer_state.json, indexes, reports, every line of
steps.jsonl, a safetensors header and the JSON inside its metadata), pickles inside torch zip files, legacy pickles,
DCP ``.metadata``, and any file as bytes or as a file-system object (a symlink, a FIFO, a folder, a sparse file)."""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import stat
import struct
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .payload import MODULE

# ---- values at every extreme, as raw JSON text (a value JSON cannot hold is written as the text a file can hold) ----

HUGE = 1 << 20
CONTROL = "\x1b]0;x\x07\x1b[2J\x00\r\n\x7f\x85\u202e\u2066[red]x[/red]{{7*7}}{% raw %}${HOME}%s%n<script>"
JSON_EXTREMES: tuple[str, ...] = (
    "0", "-1", "-0.0", "2147483648", "-2147483649", "9223372036854775807", "9223372036854775808",
    "18446744073709551616", "1" + "0" * 400, "1e400", "-1e400", "1e-400", "NaN", "Infinity", "-Infinity",
    "0.5", "2.0", "null", "true", '""', '"nan"', '"-1"', "9" * 5000, "[]", "{}", "[0.5, 2.0]", "[1.0, 0.999]",
    "[-0.1, 0.999]", "[0.9]", json.dumps("A" * HUGE), json.dumps(CONTROL), json.dumps(CONTROL, ensure_ascii=False),
    '"\udcff\udcfe\udc80"', json.dumps("é" * 1000, ensure_ascii=False),
)
PY_EXTREMES: tuple[Any, ...] = (0, -1, 2**31, 2**63, -(2**63) - 1, 10**400, float("nan"), float("inf"), float("-inf"),
                                0.5, 2.0, -0.0, None, True, "", "A" * HUGE, CONTROL, (0.5, 2.0), (1.0, 0.999),
                                (-0.1, 0.999), [], {}, "é" * 1000)
KEYS = ("lr", "betas", "eps", "step", "global_step", "weight_decay", "momentum", "shape", "data_offsets", "dtype",
        "format", "world_size", "params", "param_names", "state", "model_factory", "step_fn", "class", "tree",
        "num_threads", "start_step", "checkpoint_every", "loss", "model", "weight_map", "rank", "cpu")


class Raw(str):
    """JSON text written as it is."""


class Pairs(list):
    """A JSON object as a list of (key, value) pairs: a key may repeat."""


def emit(x: Any) -> str:
    """JSON text of ``x`` with Raw tokens as they are and Pairs as objects with repeated keys."""
    if isinstance(x, Raw):
        return str(x)
    if isinstance(x, Pairs):
        return "{" + ",".join(f"{emit(k)}:{emit(v)}" for k, v in x) + "}"
    if isinstance(x, dict):
        return "{" + ",".join(f"{emit(str(k))}:{emit(v)}" for k, v in x.items()) + "}"
    if isinstance(x, (list, tuple)):
        return "[" + ",".join(emit(v) for v in x) + "]"
    return json.dumps(x, ensure_ascii=False)


def encode(text: str) -> bytes:
    return text.encode("utf-8", "surrogateescape")


def _paths(x: Any, prefix: tuple = ()) -> list[tuple]:
    """Every node's path in a JSON file or a loaded checkpoint (keys and indexes), the root first; the first 200 keys
    and 50 items of a container, 8 levels deep: the seeds' structure, not their bulk."""
    out = [prefix]
    if len(prefix) > 8:
        return out
    if isinstance(x, dict):
        for k, v in list(x.items())[:200]:
            out += _paths(v, (*prefix, k))
    elif isinstance(x, (list, tuple)):
        for i, v in enumerate(x[:50]):
            out += _paths(v, (*prefix, i))
    return out


def _get(x: Any, path: tuple) -> Any:
    for p in path:
        x = x[p]
    return x


def _set(x: Any, path: tuple, value: Any) -> Any:
    """``x`` with the node at ``path`` replaced, copied on the way (a tuple stays a tuple)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(x, dict):
        return {**x, head: _set(x[head], rest, value)}
    y = list(x)
    y[head] = _set(y[head], rest, value)
    return tuple(y) if isinstance(x, tuple) else y


def _pick_path(rng: random.Random, tree: Any) -> list:
    """A node's path, nodes under an interesting key (lr, betas, shape...) twice as likely."""
    paths = _paths(tree)
    hot = [p for p in paths if any(k in KEYS for k in p if isinstance(k, str))]
    return list(rng.choice(hot if hot and rng.random() < 0.5 else paths))


def _nest(value: Any, depth: int, kind: str) -> Any:
    """``value`` wrapped ``depth`` deep, as raw text (no recursion, any depth)."""
    inner = emit(value)
    if kind == "list":
        return Raw("[" * depth + inner + "]" * depth)
    return Raw('{"a":' * depth + inner + "}" * depth)


def mutate_json(tree: Any, arg: dict) -> Any:
    """One structural change of a JSON tree: ``arg`` says which (op), where (path) and with what."""
    path, op = tuple(arg["path"]), arg["op"]
    if op == "value":
        return _set(tree, path, Raw(JSON_EXTREMES[arg["value"]]))
    node = _get(tree, path)
    if op == "nest":
        return _set(tree, path, _nest(node, arg["depth"], arg["kind"]))
    if op == "repeat":
        return _set(tree, path, Raw("[" + ",".join([emit(node)] * arg["n"]) + "]"))
    if op == "type":
        swapped = {dict: lambda v: list(v.values()), list: lambda v: {str(i): x for i, x in enumerate(v)},
                   str: lambda v: len(v), int: str, float: str, bool: str, type(None): lambda v: []}
        return _set(tree, path, swapped.get(type(node), lambda v: None)(node))
    if op == "dupkey":
        if isinstance(node, dict) and node:
            key = sorted(node)[arg["index"] % len(node)]
            return _set(tree, path, Pairs([*node.items(), (key, Raw(JSON_EXTREMES[arg["value"]]))]))
        return tree
    if op == "drop":
        if isinstance(node, dict) and node:
            key = sorted(node)[arg["index"] % len(node)]
            return _set(tree, path, {k: v for k, v in node.items() if k != key})
        if isinstance(node, list) and node:
            return _set(tree, path, node[:-1])
        return tree
    raise ValueError(op)


def gen_json(rng: random.Random, tree: Any) -> dict:
    op = rng.choice(("value", "value", "value", "nest", "repeat", "type", "dupkey", "drop"))
    arg: dict[str, Any] = {"op": op, "path": _pick_path(rng, tree)}
    if op in ("value", "dupkey"):
        arg["value"] = rng.randrange(len(JSON_EXTREMES))
    if op == "nest":
        arg.update(depth=rng.choice((101, 1000, 100_000)), kind=rng.choice(("list", "dict")))
    if op == "repeat":
        arg["n"] = rng.choice((2, 1000, 100_000))
    if op in ("dupkey", "drop"):
        arg["index"] = rng.randrange(1000)
    return arg


# ---- the formats ---------------------------------------------------------------------------------------------------


def _kind(path: Path) -> str:
    name = path.name
    if path.is_dir():
        return "dir"
    if name.endswith(".jsonl"):
        return "jsonl"
    if name.endswith(".json"):
        return "json"
    if name.endswith(".safetensors"):
        return "safetensors"
    if name == ".metadata":
        return "dcp"
    with open(path, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":
        return "torchzip"
    if head[:1] == b"\x80":
        return "pickle"
    return "bytes"


def _st_split(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]), data[8 + n:]


def _st_join(header: Any, body: bytes) -> bytes:
    raw = encode(emit(header))
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + body


def _zip_members(data: bytes) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        return {n: z.read(n) for n in z.namelist()}


def _zip_join(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for n, b in members.items():
            z.writestr(n, b)
    return buf.getvalue()


def mutate_object(obj: Any, arg: dict) -> Any:
    """One change of a loaded checkpoint's object tree: a value at an extreme, a container nested or repeated (shared
    references, as a pickle memo makes them), a type swapped, a tensor swapped for a hostile one."""
    path, op = tuple(arg["path"]), arg["op"]
    node = _get(obj, path)
    if op == "value":
        return _set(obj, path, PY_EXTREMES[arg["value"]])
    if op == "nest":
        for _ in range(arg["depth"]):
            node = [node]
        return _set(obj, path, node)
    if op == "repeat":
        return _set(obj, path, [node] * arg["n"])
    if op == "type":
        return _set(obj, path, list(node.values()) if isinstance(node, dict) else str(node)[:100])
    if op == "tensor":
        hostile = {"expand": lambda: torch.zeros(1).expand(2**40),
                   "scalar_str": lambda: "tensor",
                   "int_for_float": lambda: torch.zeros(3, dtype=torch.int64),
                   "empty": lambda: torch.empty(0),
                   "huge_shape_view": lambda: torch.zeros(1).as_strided((2**31, 2**31), (0, 0)),
                   "nan": lambda: torch.full((4,), float("nan")),
                   "complex": lambda: torch.zeros(2, dtype=torch.complex64),
                   "bool": lambda: torch.ones(2, dtype=torch.bool)}
        return _set(obj, path, hostile[arg["tensor"]]())
    raise ValueError(op)


def gen_object(rng: random.Random, obj: Any) -> dict:
    paths = _paths(obj)
    hot = [p for p in paths if any(k in KEYS for k in p if isinstance(k, str))]
    path = list(rng.choice(hot if hot and rng.random() < 0.6 else paths))
    op = rng.choice(("value", "value", "value", "nest", "repeat", "type", "tensor"))
    arg: dict[str, Any] = {"op": op, "path": path}
    if op == "value":
        arg["value"] = rng.randrange(len(PY_EXTREMES))
    if op == "nest":
        arg["depth"] = rng.choice((101, 500))
    if op == "repeat":
        arg["n"] = rng.choice((1000, 1_000_000))
    if op == "tensor":
        arg["tensor"] = rng.choice(("expand", "scalar_str", "int_for_float", "empty", "huge_shape_view", "nan",
                                    "complex", "bool"))
    return arg


def hostile_pickle(kind: str, n: int) -> bytes:
    """A pickle stream no writer makes: nested ``n`` deep, a global that names the payload, a string that claims more
    bytes than follow, ``n`` memo references to one dict."""
    if kind == "deep":
        return b"\x80\x02" + b"]" * n + b"a" * (n - 1) + b"."  # EMPTY_LIST n times, APPEND n-1 times
    if kind == "deep_tuple":
        return b"\x80\x02" + b")" * 1 + b"\x85" * n + b"."  # TUPLE1 n times around ()
    if kind == "payload":
        return b"\x80\x02c" + MODULE.encode() + b"\nbuild\n)R."
    if kind == "long_string":
        return b"\x80\x02X" + struct.pack("<I", 0xFFFFFFFF) + b"abc."
    if kind == "memo":
        return b"\x80\x02}q\x00" + b"(" + b"h\x00" * n + b"l."  # one dict, n references in a list
    raise ValueError(kind)


def _pickle_member(members: dict[str, bytes]) -> str:
    return next(n for n in members if n.endswith("data.pkl"))


# ---- the mutators: (which files, argument generator, apply) ---------------------------------------------------------

Gen = Callable[[random.Random, Path], Any]
Apply = Callable[[Path, Any], None]


def _bytes(path: Path) -> bytes:
    return path.read_bytes()


def gen_truncate(rng: random.Random, path: Path) -> Any:
    size = path.stat().st_size
    return rng.choice([0, 1, 7, 8, 9, 64, size // 2, max(size - 1, 0), max(size - 9, 0)])


def apply_truncate(path: Path, cut: int) -> None:
    path.write_bytes(_bytes(path)[:cut])


def gen_extend(rng: random.Random, path: Path) -> Any:
    return [rng.choice(("zeros", "garbage", "self")), rng.choice((1, 8, 4096, HUGE))]


def apply_extend(path: Path, arg: Any) -> None:
    how, n = arg
    data = _bytes(path)
    tail = {"zeros": bytes(n), "garbage": random.Random(n).randbytes(n), "self": (data * (n // max(len(data), 1) + 1))[:n]}
    path.write_bytes(data + tail[how])


def gen_flip(rng: random.Random, path: Path) -> Any:
    size = path.stat().st_size
    span = min(size, 64) if rng.random() < 0.7 else size
    return [[rng.randrange(max(span, 1)), rng.randrange(8)] for _ in range(rng.choice((1, 2, 8)))]


def apply_flip(path: Path, flips: Any) -> None:
    data = bytearray(_bytes(path))
    for offset, bit in flips:
        if offset < len(data):
            data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


REPLACEMENTS = ("symlink_outside", "symlink_dangling", "symlink_loop", "symlink_sibling", "fifo", "folder",
                "sparse", "sparse_tail", "empty", "socket")


def gen_replace(rng: random.Random, path: Path) -> Any:
    return rng.choice(REPLACEMENTS)


def apply_replace(path: Path, how: str) -> None:
    """The file (or folder) replaced by another kind of file-system object of the same name."""
    import shutil
    import socket

    data = b"" if path.is_dir() else _bytes(path)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
    if how == "symlink_outside":
        secret = path.parents[len(path.parents) - 1] / "etc" / "passwd"
        os.symlink(secret if secret.exists() else "/etc/passwd", path)
    elif how == "symlink_dangling":
        os.symlink(path.parent / "no-such-file", path)
    elif how == "symlink_loop":
        os.symlink(path.name, path)
    elif how == "symlink_sibling":
        siblings = sorted(p for p in path.parent.iterdir() if p.is_file())
        os.symlink(siblings[0].name if siblings else "..", path)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "folder":
        path.mkdir()
        (path / "x").write_bytes(data[:64])
    elif how == "sparse":
        with open(path, "wb") as f:
            f.truncate(10 * 2**30)
    elif how == "sparse_tail":
        with open(path, "wb") as f:
            f.write(data)
            f.truncate(len(data) + 10 * 2**30)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "socket":
        s = socket.socket(socket.AF_UNIX)
        try:
            s.bind(str(path))
        except OSError:  # a path too long for a socket: a FIFO instead
            os.mkfifo(path)
        finally:
            s.close()
    else:
        raise ValueError(how)


def gen_jsonfile(rng: random.Random, path: Path) -> Any:
    return gen_json(rng, json.loads(path.read_text()))


def apply_jsonfile(path: Path, arg: Any) -> None:
    path.write_bytes(encode(emit(mutate_json(json.loads(path.read_text()), arg))))


def gen_jsonl(rng: random.Random, path: Path) -> Any:
    lines = path.read_text().splitlines()
    op = rng.choice(("line", "line", "repeat", "swap", "garbage"))
    i = rng.randrange(len(lines))
    if op == "line":
        return {"op": op, "line": i, "json": gen_json(rng, json.loads(lines[i]))}
    return {"op": op, "line": i, "n": rng.choice((2, 10_000))}


def apply_jsonl(path: Path, arg: Any) -> None:
    lines = path.read_bytes().splitlines()
    i = arg["line"]
    if arg["op"] == "line":
        lines[i] = encode(emit(mutate_json(json.loads(lines[i]), arg["json"])))
    elif arg["op"] == "repeat":
        lines[i:i + 1] = [lines[i]] * arg["n"]
    elif arg["op"] == "swap":
        lines[i], lines[-1] = lines[-1], lines[i]
    else:
        lines.insert(i, b"\xff\xfe\x00{garbage" * (arg["n"] // 100 + 1))
    path.write_bytes(b"\n".join(lines) + b"\n")


def gen_safetensors(rng: random.Random, path: Path) -> Any:
    header, _ = _st_split(_bytes(path))
    r = rng.random()
    if r < 0.15:
        return {"op": "length", "value": rng.choice((0, 1, 7, 2**31, 2**63, 2**64 - 1, -1, +1))}
    meta = header.get("__metadata__") or {}
    inner = [k for k, v in meta.items() if isinstance(v, str) and v[:1] in "[{"]
    if inner and r < 0.4:
        key = rng.choice(sorted(inner))
        return {"op": "meta_json", "key": key, "json": gen_json(rng, json.loads(meta[key]))}
    return {"op": "header", "json": gen_json(rng, header)}


def apply_safetensors(path: Path, arg: Any) -> None:
    data = _bytes(path)
    header, body = _st_split(data)
    if arg["op"] == "length":
        (n,) = struct.unpack("<Q", data[:8])
        v = arg["value"]
        n = n + v if v in (-1, 1) else v
        path.write_bytes(struct.pack("<Q", n % 2**64) + data[8:])
        return
    if arg["op"] == "meta_json":
        meta = dict(header["__metadata__"])
        meta[arg["key"]] = Raw(json.dumps(emit(mutate_json(json.loads(meta[arg["key"]]), arg["json"])),
                                          ensure_ascii=False))
        header = {**header, "__metadata__": meta}
    else:
        header = mutate_json(header, arg["json"])
    path.write_bytes(_st_join(header, body))


def _load(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")


def _save(obj: Any, legacy: bool) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf, _use_new_zipfile_serialization=not legacy)
    return buf.getvalue()


def gen_torch(rng: random.Random, path: Path) -> Any:
    if rng.random() < 0.3:
        kind = rng.choice(("deep", "deep_tuple", "payload", "long_string", "memo"))
        return {"op": "raw_pickle", "kind": kind, "n": rng.choice((101, 1000, 300_000)) if kind != "memo" else 10**6}
    return {"op": "object", "object": gen_object(rng, _load(_bytes(path)))}


def apply_torch(path: Path, arg: Any) -> None:
    data = _bytes(path)
    legacy = not data.startswith(b"PK")
    if arg["op"] == "raw_pickle":
        stream = hostile_pickle(arg["kind"], arg["n"])
        if legacy:
            path.write_bytes(stream)
        else:
            members = _zip_members(data)
            members[_pickle_member(members)] = stream
            path.write_bytes(_zip_join(members))
        return
    path.write_bytes(_save(mutate_object(_load(data), arg["object"]), legacy))


def gen_dcp(rng: random.Random, path: Path) -> Any:
    r = rng.random()
    if r < 0.4:
        kind = rng.choice(("deep", "deep_tuple", "payload", "long_string", "memo"))
        return {"op": "raw_pickle", "kind": kind, "n": rng.choice((101, 1000, 300_000)) if kind != "memo" else 10**6}
    md = pickle.loads(_bytes(path))
    keys = sorted(k for k, v in md.state_dict_metadata.items() if hasattr(v, "chunks"))
    return {"op": rng.choice(("size", "offset", "chunks", "key")), "key": rng.choice(keys),
            "value": rng.choice((0, -1, 2**31, 2**63, 10**6)), "n": rng.choice((2, 1000, 20_000))}


def apply_dcp(path: Path, arg: Any) -> None:
    if arg["op"] == "raw_pickle":
        path.write_bytes(hostile_pickle(arg["kind"], arg["n"]))
        return
    md = pickle.loads(_bytes(path))
    entry = md.state_dict_metadata[arg["key"]]
    if arg["op"] == "size":
        entry.size = torch.Size([arg["value"], *entry.size[1:]])
    elif arg["op"] == "offset":
        entry.chunks[0].offsets = torch.Size([arg["value"], *entry.chunks[0].offsets[1:]])
    elif arg["op"] == "chunks":
        entry.chunks = list(entry.chunks) * arg["n"]
    else:
        md.state_dict_metadata[CONTROL + "A" * min(arg["n"], 5000)] = md.state_dict_metadata.pop(arg["key"])
    path.write_bytes(pickle.dumps(md))


def gen_manifest_code(rng: random.Random, path: Path) -> Any:
    return [rng.choice(("model_factory", "step_fn")), rng.choice((f"{MODULE}:build", f"{MODULE}.py:build"))]


def apply_manifest_code(path: Path, arg: Any) -> None:
    """The manifest names the payload planted at the tree's root: a module name, or the file (for an incident's
    manifest, a file of the run around it)."""
    field, name = arg
    manifest = json.loads(path.read_text())
    if name.endswith(".py:build"):
        root = next(p for p in path.parents if (p / f"{MODULE}.py").exists())
        name = f"{root / MODULE}.py:build"
    manifest[field] = name
    path.write_text(json.dumps(manifest))


@dataclass(frozen=True)
class Mutator:
    kinds: tuple[str, ...]  # the file kinds it applies to (``_kind``); "*" any file, "dir" a folder
    gen: Gen
    apply: Apply
    only: str | None = None  # a file name it applies to alone


MUTATORS: dict[str, Mutator] = {
    "truncate": Mutator(("*",), gen_truncate, apply_truncate),
    "extend": Mutator(("*",), gen_extend, apply_extend),
    "flip": Mutator(("*",), gen_flip, apply_flip),
    "replace": Mutator(("*", "dir"), gen_replace, apply_replace),
    "json": Mutator(("json",), gen_jsonfile, apply_jsonfile),
    "jsonl": Mutator(("jsonl",), gen_jsonl, apply_jsonl),
    "safetensors": Mutator(("safetensors",), gen_safetensors, apply_safetensors),
    "torch": Mutator(("torchzip", "pickle"), gen_torch, apply_torch),
    "dcp": Mutator(("dcp",), gen_dcp, apply_dcp),
    "manifest_code": Mutator(("json",), gen_manifest_code, apply_manifest_code, only="manifest.json"),
}
STRUCTURAL = {"json": 4, "jsonl": 3, "safetensors": 4, "torch": 4, "dcp": 4, "manifest_code": 1}  # weights
GENERIC = {"truncate": 1, "extend": 1, "flip": 1, "replace": 1}


@dataclass(frozen=True)
class Mutation:
    mutator: str
    target: str  # path relative to the examined tree
    arg: Any

    def apply(self, tree: Path) -> None:
        MUTATORS[self.mutator].apply(tree / self.target, self.arg)

    def describe(self) -> str:
        text = json.dumps(self.arg, ensure_ascii=True, default=str)
        return f"{self.mutator} {self.target} {text[:160]}{'...' if len(text) > 160 else ''}"


def apply_chain(tree: Path, parts: Any) -> None:
    for part in parts:
        Mutation(**part).apply(tree)


MUTATORS["chain"] = Mutator((), lambda rng, path: [], apply_chain)  # several mutations in turn, made by ``generate``


def targets(tree: Path) -> list[Path]:
    """The files and folders of a tree a mutation may hit: not the planted payload, nor a ``--code`` script (code the
    user chose to run, not an artifact)."""
    return sorted(p for p in tree.rglob("*") if p.suffix != ".py" and _mutable(p))


def _mutable(path: Path) -> bool:
    """A real folder, or a regular file small enough to read whole (not a symlink, FIFO or sparse file an earlier
    mutation of a chain left: reading those would block or read gigabytes)."""
    st = path.lstat()
    return stat.S_ISDIR(st.st_mode) or (stat.S_ISREG(st.st_mode) and st.st_size <= 64 * 2**20)


def generate(rng: random.Random, tree: Path, chain: float = 0.25) -> Mutation:
    """A mutation of the seed ``tree``, applied to it: one (a target, then a mutator that applies to its kind,
    structural ones preferred: a header's numbers say more than a flipped bit), or with probability ``chain`` two
    or three in turn (a checkpoint and the step log both damaged; a header changed, then cut)."""
    parts = [_one(rng, tree)]
    parts[0].apply(tree)
    while rng.random() < chain and len(parts) < 3:
        parts.append(_one(rng, tree))
        parts[-1].apply(tree)
    return parts[0] if len(parts) == 1 else Mutation("chain", "", [asdict(p) for p in parts])


def _one(rng: random.Random, tree: Path) -> Mutation:
    target = rng.choice(targets(tree))
    kind = _kind(target)
    choices = {name: w for name, w in {**STRUCTURAL, **GENERIC}.items()
               if (kind in MUTATORS[name].kinds or ("*" in MUTATORS[name].kinds and kind != "dir")
                   or (kind == "dir" and "dir" in MUTATORS[name].kinds))
               and MUTATORS[name].only in (None, target.name)}
    names = sorted(choices)
    name = rng.choices(names, weights=[choices[n] for n in names])[0]
    return Mutation(name, str(target.relative_to(tree)), MUTATORS[name].gen(rng, target))


def shrink(mutation: Mutation) -> list[Mutation]:
    """Smaller variants of a mutation, for minimising a crash: sizes, depths and counts lowered, cuts moved."""
    out = []

    def smaller(arg: Any) -> list[Any]:
        found = []
        if isinstance(arg, dict):
            for k, v in arg.items():
                if isinstance(v, int) and not isinstance(v, bool) and k in ("n", "depth") and v > 2:
                    for w in (max(2, v // 10), v // 2):
                        found.append({**arg, k: w})
                elif isinstance(v, (dict, list)):
                    found += [{**arg, k: s} for s in smaller(v)]
        elif isinstance(arg, list) and len(arg) == 2 and isinstance(arg[1], int) and arg[1] > 1 and arg[0] in (
                "zeros", "garbage", "self"):
            found.append([arg[0], max(1, arg[1] // 16)])
        elif isinstance(arg, list) and arg and all(isinstance(f, list) for f in arg) and len(arg) > 1:
            found += [arg[:1], arg[1:]]
        return found

    if mutation.mutator == "chain":  # each part alone, then the parts made smaller
        out += [Mutation(**part) for part in mutation.arg]
        for i, part in enumerate(mutation.arg):
            out += [Mutation("chain", "", [*mutation.arg[:i], asdict(m), *mutation.arg[i + 1:]])
                    for m in shrink(Mutation(**part))]
        return out
    for arg in smaller(mutation.arg):
        out.append(Mutation(mutation.mutator, mutation.target, arg))
    return out


