"""Every pickle checked on its opcode stream before any unpickler runs: how deep it nests, how much it expands to.

An unpickler builds what the stream says: a tuple nested 300,000 deep (300 KB) is built without complaint, and then
hashing it, printing it or freeing it recurses until the C stack is gone (a segmentation fault, no error line); one
container memo-referenced a million times is one object to the unpickler, and a million to whatever walks it (a
param group so referenced took more than 2 GiB to process). ``check_pickle`` walks the opcodes once
(``pickletools.genops``: a loop, no recursion), keeping for each value on the unpickler's stack how deep it nests and
how many objects it stands for once every memo reference is followed, and refuses the file past ``MAX_NESTING`` or
``MAX_PICKLE_OBJECTS`` (README, Security). Every PyTorch file (the ``.pkl`` records of a zip file, the pickles of a
legacy one) and DCP's ``.metadata`` pass here first (``formats.torch_file``, ``formats.dcp``).

A stream the walk cannot follow (damage, an unknown opcode) is left to the unpickler, which stops at the same place
and says so in its own words: the walk refuses only what it has proved too deep or too large.
"""

from __future__ import annotations

import os
import pickletools
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import BadInput
from ..inputs import MAX_NESTING, MAX_PICKLE_OBJECTS, MAX_TEXT_BYTES

_ZIP_MAGIC = b"PK\x03\x04"
_LEGACY_PICKLES = 5  # a legacy torch.save file: magic number, protocol, sys info, the object, its storage keys
_IN_PLACE = frozenset({"APPEND", "APPENDS", "SETITEM", "SETITEMS", "ADDITEMS", "BUILD"})  # change the value below
_BUILT = frozenset({"REDUCE", "NEWOBJ", "NEWOBJ_EX", "OBJ", "INST"})  # an object made of its argument tuple's items
_CONTAINERS = (pickletools.pylist, pickletools.pydict, pickletools.pytuple, pickletools.pyset, pickletools.pyfrozenset)
_PUT = frozenset({"PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"})
_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})


@dataclass
class _Value:
    """One value of the unpickler's stack; the memo holds the same record, so what an in-place op (``SETITEMS``)
    adds to a container counts wherever it is referenced."""

    depth: int  # containers nested in it, itself included
    objects: int  # objects it stands for, every memo reference followed (capped past the limit)
    shared: bool = False  # referenced again (GET, DUP): changed after that, a count taken before would be short


def _atom() -> _Value:
    return _Value(0, 1)


class _Unfollowable(Exception):
    """The stream is damaged where the walk got to: the unpickler will say so."""


class _Bounded:
    """A stream of ``size`` bytes: a read that claims more than is left is damage, never an allocation of its claim (a
    string op may claim 2^62 bytes). No ``tell``: genops asks for none then."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self._f, self._left = f, size

    def read(self, n: int = -1) -> bytes:
        if n > self._left:
            raise _Unfollowable
        data = self._f.read(self._left if n < 0 else n)
        self._left -= len(data)
        return data

    def readline(self, limit: int = -1) -> bytes:
        data = self._f.readline(self._left)
        self._left -= len(data)
        return data


def check_pickle(f: BinaryIO, size: int, where: Path) -> None:
    """Refuse, naming ``where``, the pickle at ``f``'s position (at most ``size`` bytes) when a value in it nests
    deeper than ``MAX_NESTING`` or stands for more than ``MAX_PICKLE_OBJECTS`` objects; leaves ``f`` after its STOP."""
    try:
        _walk(_Bounded(f, size), where)
    except _Unfollowable:
        return


def _walk(stream: _Bounded, where: Path) -> None:
    stack: list[_Value] = []
    marks: list[int] = []
    memo: dict[object, _Value] = {}
    try:
        for op, arg, _ in pickletools.genops(stream):
            name = op.name
            if name == "MARK":
                marks.append(len(stack))
                continue
            if name in _PUT:
                if not stack:
                    raise _Unfollowable
                memo[len(memo) if name == "MEMOIZE" else arg] = stack[-1]
                continue
            if name in _GET:
                stack.append(memo.get(arg) or _atom())
                stack[-1].shared = True
            elif name == "DUP":
                stack.append(stack[-1] if stack else _atom())
                stack[-1].shared = True
            else:
                _apply(op, stack, marks, where)
            top = stack[-1] if stack else _atom()
            if top.depth > MAX_NESTING:
                raise BadInput(where, f"its pickle nests more than {MAX_NESTING} deep: refused before unpickling")
            if top.objects > MAX_PICKLE_OBJECTS:
                raise BadInput(where, f"its pickle stands for more than {MAX_PICKLE_OBJECTS} objects once its shared "
                                      "references are followed: refused before unpickling")
    except (ValueError, IndexError):  # an unknown opcode, a truncated argument, a stack the stream empties
        raise _Unfollowable from None


def _apply(op: pickletools.OpcodeInfo, stack: list[_Value], marks: list[int], where: Path) -> None:
    """The stack effect of ``op`` on what its values nest and stand for."""
    before = op.stack_before
    popped: list[_Value] = []
    if pickletools.markobject in before:
        mark = marks.pop()
        popped, stack[mark:] = stack[mark:], []
        below = before.index(pickletools.markobject)
    else:
        below = len(before)
    if below > len(stack):
        raise _Unfollowable
    base = stack[len(stack) - below:] if below else []
    del stack[len(stack) - below:]
    children = base + popped
    if op.name in _IN_PLACE:
        container, others = children[0], children[1:]
        if container.shared:  # the pickler fills a container before it refers to it; a cycle, or a hostile stream
            raise BadInput(where, "its pickle changes a container after referring to it (a cycle, or a shared value "
                                  "filled late): refused before unpickling")
        container.depth = max([container.depth, *(1 + c.depth for c in others)])
        container.objects = min(MAX_PICKLE_OBJECTS + 1, container.objects + sum(c.objects for c in others))
        stack.append(container)
        return
    for kind in op.stack_after:
        # a container is a level, empty too; an object built from an argument tuple holds its items, one level less
        depth = max((c.depth for c in children), default=0) + (op.name not in _BUILT and (bool(children) or
                                                                                          kind in _CONTAINERS))
        stack.append(_Value(depth, min(MAX_PICKLE_OBJECTS + 1, 1 + sum(c.objects for c in children))))


def check_torch_file(f: BinaryIO, where: Path) -> None:
    """Every pickle of the ``torch.save`` file at ``f`` (from its current position to its end), checked before
    ``torch.load`` reads it: the ``.pkl`` records of a zip file, the leading pickles of a legacy one."""
    start = f.tell()
    end = f.seek(0, os.SEEK_END)
    f.seek(start)
    if f.read(4) == _ZIP_MAGIC:
        f.seek(start)
        _check_zip(f, where)
    else:
        f.seek(start)
        for _ in range(_LEGACY_PICKLES):
            before = f.tell()
            check_pickle(f, end - before, where)
            if f.tell() == before:
                break
    f.seek(start)


def _check_zip(f: BinaryIO, where: Path) -> None:
    try:
        archive = zipfile.ZipFile(f)
        records = [info for info in archive.infolist() if info.filename.endswith(".pkl")]
    except (zipfile.BadZipFile, OSError, ValueError, EOFError):
        return  # torch.load says what is wrong with it
    with archive:
        for info in records:
            if info.file_size > MAX_TEXT_BYTES:
                raise BadInput(where, f"its pickle {info.filename} claims {info.file_size} bytes, more than the "
                                      f"{MAX_TEXT_BYTES} this nanforensics reads of one")
            try:
                with archive.open(info) as record:
                    check_pickle(record, info.file_size, where)  # type: ignore[arg-type]
            except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError):
                return
