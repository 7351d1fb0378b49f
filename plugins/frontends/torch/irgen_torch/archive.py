"""Looking inside a ``.pt2`` / ``.pth`` zip archive before torch reads it.

``torch.export.load`` trusts its file: it unpickles with ``weights_only=False``
whatever member its config marks ``use_pickle`` (and the sample inputs or the
legacy weights when the weights-only loader refuses them), ``pickle.loads`` the
``opaque_obj_*`` constants, loads AOTInductor shared libraries, evaluates the
``expr_str`` of every symbolic size with ``sympy.sympify`` (that is: ``eval``)
and allocates ``torch.zeros(shape)`` for an empty weight record of any shape.

This module reads the archive itself first, with :mod:`zipfile` on the already
opened file and nothing extracted to disk, and refuses, naming the member:

- what is not a well formed archive (truncated, corrupt, duplicate or
  case-colliding member names, which torch's reader and Python's would
  resolve differently, encrypted or oddly compressed members);
- members whose declared size is over the limit, and compressed members whose
  declared size is far out of proportion with their data (a zip bomb);
- weights and constants whose declared shape is over ``--max-tensor-bytes``;
- unless ``--allow-pickle``: pickled members that import anything besides
  the plain tensor types torch's weights-only loader accepts, pickled Python
  or TorchScript objects, AOTInductor compiled code, and symbolic expressions
  that are not plain sympy constructors.

It is the first of two layers: :mod:`irgen_torch.guard` also stops any
unpickling while torch loads the file, in case torch reads something this
module did not foresee.
"""

from __future__ import annotations

import io
import json
import os
import pickletools
import re
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from irgen.plugin import MAX_JSON_BYTES, IrgenError, check_tensor_size, human_bytes

#: archives with more members than this are refused
MAX_MEMBERS = 100_000
#: a compressed member may not declare more than this many times its compressed size (torch
#: itself never compresses; weights deflate to ~90 %, JSON to ~10 %)
MAX_RATIO = 50

# the records torch.export.pt2_archive reads (torch.export.pt2_archive.constants)
ARCHIVE_FORMAT = "archive_format"
ARCHIVE_VERSION = "archive_version"
MODELS_DIR = "models/"
WEIGHTS_DIR = "data/weights/"
CONSTANTS_DIR = "data/constants/"
SAMPLE_INPUTS = "data/sample_inputs/{}.pt"
WEIGHTS_CONFIG = "data/weights/{}_weights_config.json"
CONSTANTS_CONFIG = "data/constants/{}_constants_config.json"
AOTINDUCTOR_DIR = "data/aotinductor/"
TENSOR_PREFIX, CUSTOM_OBJ_PREFIX, OPAQUE_OBJ_PREFIX = "tensor_", "custom_obj_", "opaque_obj_"
# the torch <= 2.6 layout torch.export.load still falls back to
LEGACY_PROGRAM = "serialized_exported_program.json"
LEGACY_PICKLES = ("serialized_state_dict.pt", "serialized_constants.pt", "serialized_example_inputs.pt",
                  "serialized_state_dict.json", "serialized_constants.json")

TRUST = "pass --allow-pickle only if you trust the file"


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def one_line(err: BaseException | str, limit: int = 200) -> str:
    """An exception's message on one line, terminal escapes and control characters shown, not sent."""
    text = " ".join(_ANSI.sub("", str(err)).split())
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return (text[:limit] + "...") if len(text) > limit else (text or type(err).__name__)


def unpickler_reason(err: BaseException) -> str:
    """The useful part of torch's weights-only refusal (which global it would not import)."""
    text = one_line(err, 2000)
    m = re.search(r"WeightsUnpickler error: (.+?)(?:\. |$)", text)
    return one_line(m.group(1) if m else text.split(". ")[0], 200)


@dataclass
class Archive:
    """What the inspection learned: the member names torch will see, and for each
    pickled member torch may unpickle its CRC-32 (so a guard can name it)."""

    path: Path
    prefix: str = ""
    records: dict[str, zipfile.ZipInfo] = field(default_factory=dict)  # torch's record name -> member
    pickled: dict[int, str] = field(default_factory=dict)  # CRC-32 -> member name
    legacy: bool = False

    def member(self, record: str) -> str:
        return self.prefix + record

    def name_of(self, data: bytes | None) -> str | None:
        """The member whose content is ``data`` (by CRC-32), if it is one torch may unpickle."""
        if data is None:
            return None
        import zlib

        return self.pickled.get(zlib.crc32(data) & 0xFFFFFFFF)


# ------------------------------------------------------------------ the zip itself


def _open_zip(f, where: str) -> zipfile.ZipFile:
    size = os.fstat(f.fileno()).st_size if hasattr(f, "fileno") else None
    if size == 0:
        raise IrgenError(f"{where}: an empty file, not a torch archive")
    try:
        f.seek(0)
        return zipfile.ZipFile(f)
    except zipfile.BadZipFile as err:
        raise IrgenError(f"{where}: not a torch archive (not a readable zip file: {one_line(err)}); "
                         f"truncated or corrupt?") from None
    except (OSError, ValueError, EOFError, NotImplementedError, IndexError, OverflowError) as err:
        raise IrgenError(f"{where}: not a readable zip file ({type(err).__name__}: {one_line(err)})") from None


def member_cap(limit: int | None, unbounded: tuple[str, ...] = ()):
    """The size limit of a member by its name: JSON documents and pickles ``MAX_JSON_BYTES``,
    names ending in ``unbounded`` none (checked inside), anything else (a tensor's storage) ``limit``."""
    def cap(name: str) -> int | None:
        if name.endswith((".json", ".pkl")):
            return MAX_JSON_BYTES
        if unbounded and name.endswith(unbounded):
            return None
        return limit

    return cap


def check_members(zf: zipfile.ZipFile, where: str, file_size: int, cap) -> list[zipfile.ZipInfo]:
    """Every member well formed and within ``cap(name)`` bytes; returns them in central-directory order."""
    infos = zf.infolist()
    if not infos:
        raise IrgenError(f"{where}: an empty zip archive, not a torch archive")
    if len(infos) > MAX_MEMBERS:
        raise IrgenError(f"{where}: {len(infos)} archive members, more than the {MAX_MEMBERS} irgen reads")
    seen: dict[str, str] = {}
    for info in infos:
        name = info.filename
        key = name.lower()  # torch's zip reader looks names up without regard to case
        if key in seen:
            raise IrgenError(f"{where}: archive member {name!r} appears twice"
                             + (f" (as {seen[key]!r})" if seen[key] != name else "")
                             + "; torch and irgen could read different copies")
        seen[key] = name
        if info.flag_bits & 0x1:
            raise IrgenError(f"{where}: archive member {name!r} is encrypted")
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise IrgenError(f"{where}: archive member {name!r} uses compression method {info.compress_type}, "
                             f"which torch cannot read")
        if info.header_offset + info.compress_size > file_size:
            raise IrgenError(f"{where}: archive member {name!r} runs past the end of the file (truncated?)")
        if info.compress_type == zipfile.ZIP_STORED and info.compress_size != info.file_size:
            raise IrgenError(f"{where}: archive member {name!r} declares {info.file_size} bytes but stores "
                             f"{info.compress_size} (corrupt?)")
        if info.compress_type == zipfile.ZIP_DEFLATED and info.file_size > max(1 << 20, MAX_RATIO * info.compress_size):
            raise IrgenError(f"{where}: archive member {name!r} declares {human_bytes(info.file_size)} from "
                             f"{human_bytes(info.compress_size)} of compressed data (a zip bomb?)")
        most = cap(name)
        if most is not None and info.file_size > most:
            raise IrgenError(f"{where}: archive member {name!r} holds {human_bytes(info.file_size)}, over the "
                             f"limit of {human_bytes(most)}"
                             + ("" if most == MAX_JSON_BYTES else "; raise it with --max-tensor-bytes if this is meant"))
    return infos


def _read(zf: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> bytes:
    try:
        return zf.read(info)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError, RuntimeError) as err:
        raise IrgenError(f"{where}: archive member {info.filename!r} cannot be read ({one_line(err)}); "
                         f"truncated or corrupt?") from None
    except Exception as err:  # noqa: BLE001  zlib.error and kin
        raise IrgenError(f"{where}: archive member {info.filename!r} cannot be read "
                         f"({type(err).__name__}: {one_line(err)})") from None


def _read_json(zf: zipfile.ZipFile, info: zipfile.ZipInfo, where: str) -> Any:
    data = _read(zf, info, where)
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise IrgenError(f"{where}: archive member {info.filename!r} is not valid JSON ({one_line(err)})") from None
    except RecursionError:
        raise IrgenError(f"{where}: archive member {info.filename!r} is not valid JSON (nested too deeply)") from None


# ------------------------------------------------------------------ pickles


def _allowed_globals() -> set[str]:
    import torch._weights_only_unpickler as wo

    return set(wo._get_allowed_globals()) | set(wo._get_user_allowed_globals())


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
               "SHORT_BINSTRING"}


def pickle_globals(data: bytes, max_pickles: int = 1) -> set[str]:
    """The ``module.name`` of every global the first ``max_pickles`` pickle streams in
    ``data`` import, read with :func:`pickletools.genops` (nothing is executed); ``"?"``
    for one that cannot be told statically. Raises ``ValueError`` on a malformed pickle."""
    found: set[str] = set()
    buf = io.BytesIO(data)
    for done in range(max_pickles):
        if buf.tell() >= len(data):
            break
        strings: list[str] = []
        memo: dict[int, str | None] = {}
        last: str | None = None
        try:
            for op, arg, _pos in pickletools.genops(buf):
                name = op.name
                if name in ("GLOBAL", "INST"):
                    found.add(str(arg).replace(" ", "."))
                    last = None
                elif name == "STACK_GLOBAL":
                    found.add(f"{strings[-2]}.{strings[-1]}" if len(strings) >= 2 else "?")
                    last = None
                elif name in _STRING_OPS:
                    last = arg if isinstance(arg, str) else arg.decode("latin-1") if isinstance(arg, bytes) else None
                    if last is not None:
                        strings.append(last)
                elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    memo[int(arg)] = last
                elif name == "MEMOIZE":
                    memo[len(memo)] = last
                elif name in ("GET", "BINGET", "LONG_BINGET"):
                    last = memo.get(int(arg))
                    if last is not None:
                        strings.append(last)
                else:
                    last = None
        except Exception as err:  # noqa: BLE001  ValueError, struct.error, UnicodeDecodeError: malformed
            if done == 0:
                raise ValueError(one_line(err)) from None
            break  # what follows the pickles of a legacy torch.save is raw storage data
    return found


def _torch_save_pickles(data: bytes, where: str, member: str, limit: int | None) -> list[bytes]:
    """The pickle streams of a ``torch.save`` payload: a zip (its ``*.pkl`` members) or a raw stream."""
    if not data.startswith(b"PK"):
        return [data]
    try:
        inner = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as err:
        raise IrgenError(f"{where}: archive member {member!r} is not a readable torch.save file ({one_line(err)})") from None
    infos = check_members(inner, f"{where}: archive member {member!r}", len(data), member_cap(limit))
    return [_read(inner, i, f"{where}: archive member {member!r}") for i in infos if i.filename.endswith(".pkl")]


def check_pickle(data: bytes, where: str, member: str, limit: int | None) -> None:
    """Refuse a member torch would unpickle when it imports more than plain tensor types."""
    allowed = _allowed_globals()
    n_zip = data.startswith(b"PK")
    for stream in _torch_save_pickles(data, where, member, limit):
        try:  # a legacy torch.save stream is five pickles (magic, protocol, info, object, keys), then data
            names = pickle_globals(stream, 1 if n_zip else 5)
        except ValueError as err:
            raise IrgenError(f"{where}: archive member {member!r} is not a readable pickle ({one_line(err)})") from None
        bad = sorted(n for n in names if n not in allowed)
        if bad:
            shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
            raise IrgenError(f"{where}: archive member {member!r} holds pickled data that imports {shown}; "
                             f"unpickling it would run code from the file: {TRUST}")


# ------------------------------------------------------------------ symbolic expressions

# torch writes symbolic sizes with sympy's srepr: Add(Mul(Integer(2), Symbol('s0', integer=True)), Integer(1));
# torch.export.load hands them to sympy.sympify, which evaluates them as Python.
_SYM_NAMES = frozenset("""
    Symbol Dummy Integer Rational Float Add Mul Max Min Mod Abs floor ceiling Eq Ne Lt Le Gt Ge
    StrictLessThan StrictGreaterThan LessThan GreaterThan Equality Unequality And Or Not true false
    True False None BooleanTrue BooleanFalse oo zoo nan NegativeOne One Zero Half Infinity
    NegativeInfinity IntInfinity NegativeIntInfinity int_oo FloorDiv ModularIndexing CleanDiv CeilDiv
    CeilToInt FloorToInt TruncToInt TruncToFloat RoundToInt ToFloat Identity Where PythonMod IntTrueDiv
    FloatTrueDiv IsNonOverlappingAndDenseIndicator Pow
""".split())
_SYM_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<num>\d{1,30}(?:\.\d{1,30})?(?:[eE][+-]?\d{1,4})?)
  | (?P<str>'[A-Za-z0-9_.+\-]{0,64}')
  | (?P<kw>[a-z_]{1,32})\s*=(?!=)\s*
  | (?P<name>[A-Za-z_][A-Za-z0-9_]{0,63})
  | (?P<op>==|!=|<=|>=|//|[-+*/%<>(),&|~])
""", re.VERBOSE)
_SYMBOL_NAME = re.compile(r"(?:s|u|zf|zuf|ps|tmp|idx|i|x|y|z|h|r0_|r1_|view|indirect|c|q|d)\d{1,9}")
_POW = re.compile(r"Pow\(\s*Symbol\('[A-Za-z0-9_]{1,64}'(?:\s*,\s*[a-z_]{1,32}\s*=\s*(?:True|False))*\s*\)\s*,"
                  r"\s*Integer\(\s*-?\d{1,2}\s*\)\s*\)")
MAX_EXPR_CHARS = 20_000


def check_sym_expr(text: Any) -> str | None:
    """None when ``text`` is a plain sympy expression that is safe to ``sympify``; else why not."""
    if not isinstance(text, str):
        return "not a string"
    if len(text) > MAX_EXPR_CHARS:
        return f"{len(text)} characters long"
    if "**" in text:
        return "uses the ** operator"
    pos = 0
    while pos < len(text):
        m = _SYM_TOKEN.match(text, pos)
        if not m:
            return f"unexpected {text[pos:pos + 10]!r}"
        if m.group("name"):
            word = m.group("name")
            if word not in _SYM_NAMES and not _SYMBOL_NAME.fullmatch(word):
                return f"unknown name {word!r}"
            if word == "Pow" and not _POW.match(text, m.start()):
                return "a power other than symbol**small integer"
        elif m.group("kw") == "precision":
            n = re.match(r"\d{1,5}", text[m.end():])
            if not n or int(n.group()) > 4096:
                return "a Float precision over 4096"
        pos = m.end()
    return None


def _expr_strings(doc: Any):
    """Every ``expr_str`` value in a JSON document (iteratively: no recursion limit)."""
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "expr_str":
                    yield v
                elif isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))


def check_program_json(doc: Any, where: str, member: str) -> None:
    for text in _expr_strings(doc):
        why = check_sym_expr(text)
        if why:
            shown = text[:60] if isinstance(text, str) else repr(text)[:60]
            raise IrgenError(f"{where}: archive member {member!r} has a symbolic expression {shown!r} that is "
                             f"not plain sympy ({why}); torch would evaluate it as Python code: {TRUST}")


# ------------------------------------------------------------------ tensors declared in a payload config


def _dtype_of(code: Any):
    try:
        from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE
        from torch._export.serde.schema import ScalarType

        return str(_SERIALIZE_TO_TORCH_DTYPE[ScalarType(code)]).replace("torch.", "")
    except Exception:  # noqa: BLE001  unknown: counted as the widest
        return "float64"


def _sizes(meta: dict, where: str, what: str) -> list[int]:
    out = []
    for d in meta.get("sizes") or []:
        if not isinstance(d, dict) or "as_int" not in d or not isinstance(d["as_int"], int) or isinstance(d["as_int"], bool):
            raise IrgenError(f"{where}: {what} has a dimension {str(d)[:60]} that is not an integer; irgen needs "
                             f"static shapes")
        out.append(d["as_int"])
    return out


def _check_payload_config(zf, ar: Archive, config_rec: str, data_dir: str, kind: str, where: str,
                          limit: int | None, allow_pickle: bool) -> None:
    info = ar.records.get(config_rec.lower())
    if info is None:
        return  # torch reports the missing config itself
    doc = _read_json(zf, info, where)
    config = doc.get("config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        raise IrgenError(f"{where}: archive member {info.filename!r} is not a payload config (no 'config' object)")
    for fqn, meta in config.items():
        what = f"{kind} {fqn!r}"
        if not isinstance(meta, dict) or not isinstance(meta.get("path_name"), str):
            raise IrgenError(f"{where}: archive member {info.filename!r}: {what} has no path_name")
        rel = meta["path_name"]
        if not rel or "/" in rel or "\\" in rel or rel in (".", ".."):
            raise IrgenError(f"{where}: archive member {info.filename!r}: {what} names the record {rel!r:.80}, "
                             f"not a plain file name")
        rec = ar.records.get((data_dir + rel).lower())
        member = ar.member(data_dir + rel)
        if kind == "constant" and rel.startswith((CUSTOM_OBJ_PREFIX, OPAQUE_OBJ_PREFIX)):
            if not allow_pickle:
                raise IrgenError(f"{where}: archive member {member!r} ({what}) is a pickled Python object; "
                                 f"unpickling it would run code from the file: {TRUST}")
            continue
        if meta.get("use_pickle"):
            if rec is not None:
                if not allow_pickle:
                    check_pickle(_read(zf, rec, where), where, member, limit)
                ar.pickled[rec.CRC] = member
            continue
        tmeta = meta.get("tensor_meta")
        if not isinstance(tmeta, dict):
            raise IrgenError(f"{where}: archive member {info.filename!r}: {what} has no tensor_meta")
        check_tensor_size(f"{where}: {what}", _sizes(tmeta, where, what), _dtype_of(tmeta.get("dtype")), limit)


# ------------------------------------------------------------------ the two kinds of file


def inspect_pt2(f, path: Path, limit: int | None, allow_pickle: bool) -> Archive:
    """Check a ``torch.export.save`` archive (open as ``f``) before torch reads it."""
    where = str(path)
    file_size = os.fstat(f.fileno()).st_size
    zf = _open_zip(f, where)
    with zf:
        infos = check_members(zf, where, file_size, member_cap(limit, unbounded=(".pt",)))
        ar = Archive(path)
        first = infos[0].filename
        if "/" in first and not first.startswith("/"):
            ar.prefix = first.split("/", 1)[0] + "/"
        if ar.prefix and all(i.filename.startswith(ar.prefix) for i in infos):
            ar.records = {i.filename[len(ar.prefix):].lower(): i for i in infos}
        else:
            ar.prefix, ar.legacy = "", True
            ar.records = {i.filename.lower(): i for i in infos}
        if ar.legacy or ARCHIVE_FORMAT not in ar.records:
            return _inspect_legacy(zf, ar, where, limit, allow_pickle)
        if ar.records[ARCHIVE_FORMAT].file_size > 64:
            raise IrgenError(f"{where}: archive_format record of {ar.records[ARCHIVE_FORMAT].file_size} bytes, "
                             f"not a torch.export archive")
        fmt = _read(zf, ar.records[ARCHIVE_FORMAT], where)
        _cross_check(f, ar, where)
        if fmt != b"pt2":
            raise IrgenError(f"{where}: archive_format is {fmt[:20]!r}, not a torch.export archive")
        # torch takes every record under models/ for a program and cuts five characters (".json")
        # off its name to find the program's other records: do exactly the same
        programs = {i.filename[len(ar.prefix):]: i for i in infos if i.filename[len(ar.prefix):].startswith(MODELS_DIR)}
        models = {rec: rec[len(MODELS_DIR):-len(".json")] for rec in programs}
        if "model" not in models.values():
            aoti = any(r.startswith(AOTINDUCTOR_DIR) for r in ar.records)
            raise IrgenError(f"{where}: holds no exported program (no models/model.json)"
                             + ("; an AOTInductor package is compiled code, not a program irgen can import" if aoti else ""))
        if not allow_pickle:
            aoti = sorted(i.filename for r, i in ar.records.items() if r.startswith(AOTINDUCTOR_DIR))
            if aoti:
                raise IrgenError(f"{where}: archive member {aoti[0]!r} is AOTInductor compiled code, which torch "
                                 f"would load and run; irgen does not need it: {TRUST}")
        for rec, name in models.items():
            prog = programs[rec]
            doc = _read_json(zf, prog, where)
            if not allow_pickle:
                check_program_json(doc, where, prog.filename)
            for payload in (SAMPLE_INPUTS.format(name), f"{WEIGHTS_DIR}{name}.pt", f"{CONSTANTS_DIR}{name}.pt"):
                info = ar.records.get(payload.lower())
                if info is not None:  # sample inputs, and the weights/constants of an older layout: torch.save pickles
                    if not allow_pickle:
                        check_pickle(_read(zf, info, where), where, info.filename, limit)
                    ar.pickled[info.CRC] = info.filename
            if f"{WEIGHTS_DIR}{name}.pt".lower() not in ar.records:
                _check_payload_config(zf, ar, WEIGHTS_CONFIG.format(name), WEIGHTS_DIR, "weight", where, limit,
                                      allow_pickle)
            if f"{CONSTANTS_DIR}{name}.pt".lower() not in ar.records:
                _check_payload_config(zf, ar, CONSTANTS_CONFIG.format(name), CONSTANTS_DIR, "constant", where, limit,
                                      allow_pickle)
        return ar


def _data_offset(f, info: zipfile.ZipInfo) -> int | None:
    f.seek(info.header_offset)
    head = f.read(30)
    if len(head) != 30 or head[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len


def _cross_check(f, ar: Archive, where: str) -> None:
    """torch reads the archive with its own zip reader (miniz): it must see exactly the members
    checked here, with the same sizes and data offsets, or a crafted zip could show the two
    readers different contents."""
    import torch

    f.seek(0)
    try:
        reader = torch._C.PyTorchFileReader(f)
        names = reader.get_all_records()
    except Exception as err:  # noqa: BLE001  c10::Error and kin
        raise IrgenError(f"{where}: torch's zip reader cannot read it ({one_line(err)})") from None
    python_side = {r for r in ar.records if not r.endswith(".debug_pkl")}
    seen = set()
    for rec in names:
        info = ar.records.get(rec.lower())
        if info is None or info.filename != ar.prefix + rec:
            raise IrgenError(f"{where}: torch's zip reader sees a member {rec!r} that Python's does not "
                             f"(a crafted zip directory?)")
        seen.add(rec.lower())
        try:
            size, offset = reader.get_record_size(rec), reader.get_record_offset(rec)
        except Exception as err:  # noqa: BLE001
            raise IrgenError(f"{where}: archive member {info.filename!r} cannot be read ({one_line(err)})") from None
        if size != info.file_size or offset != _data_offset(f, info):
            raise IrgenError(f"{where}: torch's zip reader and Python's disagree about archive member "
                             f"{info.filename!r} (a crafted zip directory?)")
    if python_side - seen:
        extra = sorted(ar.records[r].filename for r in python_side - seen)[0]
        raise IrgenError(f"{where}: archive member {extra!r} is not seen by torch's zip reader (a crafted zip directory?)")


def _inspect_legacy(zf, ar: Archive, where: str, limit: int | None, allow_pickle: bool) -> Archive:
    """The pre-2.7 layout (``version``, ``serialized_exported_program.json``, ``serialized_*.pt``)."""
    # torch.export.load reads it with zipfile: names are exact, at the top level
    names = {i.filename: i for i in zf.infolist()}
    if "version" not in names or LEGACY_PROGRAM not in names:
        raise IrgenError(f"{where}: not a torch.export archive (no archive_format record)")
    if any(n.rsplit("/", 1)[-1].lower() == ARCHIVE_FORMAT for n in names):
        # torch's own reader could still take the current layout out of it
        raise IrgenError(f"{where}: mixes the current torch.export layout (archive_format) with the pre-2.7 one")
    ar.legacy, ar.prefix = True, ""
    ar.records = {n.lower(): i for n, i in names.items()}
    if not allow_pickle:
        check_program_json(_read_json(zf, names[LEGACY_PROGRAM], where), where, LEGACY_PROGRAM)
    for rec in LEGACY_PICKLES:
        info = names.get(rec)
        if info is not None:
            if not allow_pickle:
                check_pickle(_read(zf, info, where), where, rec, limit)
            ar.pickled[info.CRC] = rec
    return ar


def inspect_pth(f, path: Path, limit: int | None) -> None:
    """A zip ``.pth`` (``torch.save`` since torch 1.6): members well formed and within the limit.
    (What it unpickles, torch's weights-only loader checks.)"""
    f.seek(0)
    head = f.read(4)
    f.seek(0)
    if not head:
        raise IrgenError(f"{path}: an empty file, not a torch file")
    if head != b"PK\x03\x04":
        return  # a legacy (pre-zip) torch.save stream, or not a torch file: torch.load tells
    zf = _open_zip(f, str(path))
    with zf:
        check_members(zf, str(path), os.fstat(f.fileno()).st_size, member_cap(limit))
