"""Every pickle checked on its opcode stream before any unpickler runs: how deep it nests, how much it expands to.

An unpickler builds what the stream says: a tuple nested 300,000 deep (300 KB) is built without complaint, and then
hashing it, printing it or freeing it recurses until the C stack is gone (a segmentation fault, no error line); one
container memo-referenced a million times is one object to the unpickler, and a million to whatever walks it (a
param group so referenced took more than 2 GiB to process). ``check_pickle`` walks the opcodes once (one loop over
the bytes, no recursion, by pickletools' own table of opcodes), keeping for each value on the unpickler's stack how
deep it nests and how many objects it stands for once every memo reference is followed, and refuses the file past
``MAX_NESTING`` or ``MAX_PICKLE_OBJECTS`` (README, Security). Every PyTorch file (the ``.pkl`` records of a zip
file, the pickles of a legacy one) and DCP's ``.metadata`` pass here first (``formats.torch_file``, ``formats.dcp``).

A stream the walk cannot follow (damage, an unknown opcode) is left to the unpickler, which stops at the same place
and says so in its own words: the walk refuses only what it has proved too deep or too large.
"""

from __future__ import annotations

import mmap
import os
import pickletools
import zipfile
from pathlib import Path
from typing import BinaryIO, NamedTuple

from ..errors import BadInput
from ..inputs import MAX_NESTING, MAX_PICKLE_OBJECTS, MAX_TEXT_BYTES

_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_PICKLES = 5  # a legacy torch.save file: magic number, protocol, sys info, the object, its storage keys


class _Value:
    """One value of the unpickler's stack; the memo holds the same record, so what an in-place op (``SETITEMS``)
    adds to a container counts wherever it is referenced."""

    __slots__ = ("depth", "objects", "shared")

    def __init__(self, depth: int, objects: int) -> None:
        self.depth = depth  # containers nested in it, itself included
        self.objects = objects  # objects it stands for, every memo reference followed (capped past the limit)
        self.shared = False  # referenced again (GET, DUP): changed after that, a count taken before would be short


class _Unfollowable(Exception):
    """The stream is damaged where the walk got to: the unpickler will say so."""


# What each opcode does, from pickletools' own table: how its argument is laid out, and its effect on the stack.
_ATOM, _EMPTY, _MARK, _PUT, _GET, _NOTHING, _STOP, _POP, _DUP, _OTHER = range(10)
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})  # change the value below
_BUILT = frozenset({"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"})  # an object made of its argument tuple's items
_CONTAINERS = (pickletools.pylist, pickletools.pydict, pickletools.pytuple, pickletools.pyset, pickletools.pyfrozenset)


class _Op(NamedTuple):
    name: str
    arg: int  # pickletools' ArgumentDescriptor.n: a fixed size, or how the size is given (negative)
    lines: int  # text arguments: how many lines
    effect: int
    below: int  # values popped below the mark (or all popped, where no mark)
    mark: bool
    after: int
    container: bool


def _op(op: pickletools.OpcodeInfo) -> _Op:
    before, after = op.stack_before, op.stack_after
    mark = pickletools.markobject in before
    below = before.index(pickletools.markobject) if mark else len(before)
    effect = {"MARK": _MARK, "PUT": _PUT, "BINPUT": _PUT, "LONG_BINPUT": _PUT, "MEMOIZE": _PUT, "GET": _GET,
              "BINGET": _GET, "LONG_BINGET": _GET, "STOP": _STOP, "POP": _POP, "DUP": _DUP}.get(op.name, _OTHER)
    if effect == _OTHER and not before:
        effect = _NOTHING if not after else _EMPTY if after[0] in _CONTAINERS else _ATOM
    lines = 2 if op.arg is not None and op.arg.name.endswith("_pair") else 1
    return _Op(op.name, op.arg.n if op.arg is not None else 0, lines, effect, below, mark, len(after),
               bool(after) and after[0] in _CONTAINERS)


_WIDTHS = {pickletools.TAKEN_FROM_ARGUMENT1: 1, pickletools.TAKEN_FROM_ARGUMENT4: 4,
           pickletools.TAKEN_FROM_ARGUMENT4U: 4, pickletools.TAKEN_FROM_ARGUMENT8U: 8}  # bytes of a length
_OPS: list[_Op | None] = [None] * 256
for _info in pickletools.opcodes:
    _OPS[ord(_info.code)] = _op(_info)


def check_pickle(data: bytes | mmap.mmap, start: int, where: Path) -> int:
    """Refuse, naming ``where``, the pickle at ``data[start:]`` when a value in it nests deeper than ``MAX_NESTING``
    or stands for more than ``MAX_PICKLE_OBJECTS`` objects; the offset after its STOP (``start`` when the walk cannot
    follow it: damage is the unpickler's to say)."""
    try:
        return _walk(data, start, where)
    except (_Unfollowable, IndexError, ValueError):
        return start


def _walk(data: bytes | mmap.mmap, i: int, where: Path) -> int:
    stack: list[_Value] = []
    marks: list[int] = []
    memo: dict[int, _Value] = {}
    end = len(data)
    while True:
        op = _OPS[data[i]]
        if op is None:
            raise _Unfollowable
        i += 1
        arg, n = i, op.arg
        if n > 0:
            i += n
        elif n == pickletools.UP_TO_NEWLINE:
            for _ in range(op.lines):
                i = data.find(b"\n", i) + 1
                if i == 0:
                    raise _Unfollowable
        elif n < 0:
            width = _WIDTHS[n]
            size = int.from_bytes(data[i:i + width], "little", signed=n == pickletools.TAKEN_FROM_ARGUMENT4)
            if size < 0:
                raise _Unfollowable
            i += width + size
        if i > end:
            raise _Unfollowable
        effect = op.effect
        if effect == _ATOM:
            stack.append(_Value(0, 1))
            continue
        if effect == _EMPTY:
            stack.append(_Value(1, 1))
        elif effect == _MARK:
            marks.append(len(stack))
            continue
        elif effect == _PUT:
            memo[len(memo) if op.name == "MEMOIZE" else _key(data[arg:i], n)] = stack[-1]
            continue
        elif effect == _GET:
            stack.append(memo.get(_key(data[arg:i], n)) or _Value(0, 1))
            stack[-1].shared = True
        elif effect == _DUP:
            stack.append(stack[-1])
            stack[-1].shared = True
        elif effect == _STOP:
            return i
        elif effect == _POP:
            stack.pop()
            continue
        elif effect == _OTHER:
            _apply(op, stack, marks, where)
        else:
            continue
        if stack:
            top = stack[-1]
            if top.depth > MAX_NESTING:
                raise BadInput(where, f"its pickle nests more than {MAX_NESTING} deep: refused before unpickling")
            if top.objects > MAX_PICKLE_OBJECTS:
                raise BadInput(where, f"its pickle stands for more than {MAX_PICKLE_OBJECTS} objects once its shared "
                                      "references are followed: refused before unpickling")


def _key(arg: bytes, n: int) -> int:
    """A memo index: text (``GET``), or a little-endian integer (``BINGET``, ``LONG_BINGET``)."""
    return int(arg) if n == pickletools.UP_TO_NEWLINE else int.from_bytes(arg, "little")


def _apply(op: _Op, stack: list[_Value], marks: list[int], where: Path) -> None:
    """The stack effect of ``op`` on what its values nest and stand for."""
    popped: list[_Value] = []
    if op.mark:
        mark = marks.pop()
        popped, stack[mark:] = stack[mark:], []
    if op.below > len(stack):
        raise _Unfollowable
    children = (stack[len(stack) - op.below:] if op.below else []) + popped
    del stack[len(stack) - op.below:]
    if op.name in _IN_PLACE:
        container, others = children[0], children[1:]
        if container.shared:  # the pickler fills a container before it refers to it; a cycle, or a hostile stream
            raise BadInput(where, "its pickle changes a container after referring to it (a cycle, or a shared value "
                                  "filled late): refused before unpickling")
        container.depth = max([container.depth, *(1 + c.depth for c in others)])
        container.objects = min(MAX_PICKLE_OBJECTS + 1, container.objects + sum(c.objects for c in others))
        stack.append(container)
        return
    # a container is a level, empty too; an object built from an argument tuple holds its items, one level less
    depth = max((c.depth for c in children), default=0) + (op.name not in _BUILT and (bool(children) or op.container))
    objects = min(MAX_PICKLE_OBJECTS + 1, 1 + sum(c.objects for c in children))
    stack.extend(_Value(depth, objects) for _ in range(op.after))


def check_torch_file(f: BinaryIO, where: Path) -> None:
    """Every pickle of the ``torch.save`` file at ``f`` (from its current position to its end), checked before
    ``torch.load`` reads it: the ``.pkl`` records of a zip file, the leading pickles of a legacy one."""
    start = f.tell()
    end = f.seek(0, os.SEEK_END)
    f.seek(start)
    if f.read(4) == _ZIP_MAGIC:
        f.seek(start)
        _check_zip(f, where)
    elif end > start:
        f.seek(start)
        try:  # a file on disk is mapped, not read: its pickles lead, its tensors' bytes follow
            data: bytes | mmap.mmap = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) if start == 0 else b""
        except (OSError, ValueError):
            data = b""
        data = data or f.read(min(end - start, MAX_TEXT_BYTES))  # a window on a blob: read, at most so much
        try:
            at = 0
            for _ in range(_LEGACY_PICKLES):
                following = check_pickle(data, at, where)
                if following == at:
                    break
                at = following
        finally:
            if isinstance(data, mmap.mmap):
                data.close()
    f.seek(start)


# what Python's zipfile raises for an archive it cannot read, from its central directory (a version it does not
# implement: NotImplementedError) to a record (an encrypted one: RuntimeError): the pre-check leaves such a file to
# torch.load, which reads it or says what is wrong with it
_ZIP_DAMAGE = (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError)


def _check_zip(f: BinaryIO, where: Path) -> None:
    try:
        archive = zipfile.ZipFile(f)
        records = [info for info in archive.infolist() if info.filename.endswith(".pkl")]
    except _ZIP_DAMAGE:
        return
    with archive:
        for info in records:
            if info.file_size > MAX_TEXT_BYTES:
                raise BadInput(where, f"its pickle {info.filename} claims {info.file_size} bytes, more than the "
                                      f"{MAX_TEXT_BYTES} this nanforensics reads of one")
            try:
                data = archive.read(info)
            except _ZIP_DAMAGE:
                return
            check_pickle(data, 0, where)
