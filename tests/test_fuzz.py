"""Fuzz the loaders: a few hundred mutated and truncated GGUF files, safetensors
files and config.json values, each run through `flashnorm-mlx verify` in a child
process. None may die by a signal, escape as a traceback, or fail silently:
every case either runs (a JSON report on stdout) or exits 1 with one
`flashnorm-mlx: error:` line on stderr.

The cases run in batches in one child (tests/fuzz_child.py) that logs a start
line before each case; a case that kills the child is found from that log and
run again alone through the real entry point, then the child carries on.
"""

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import tiny
from test_gguf import write_tiny_gguf

HERE = Path(__file__).parent
ARGS = ["-g", "1", "--json", "--dtype", "float32"]
SEED = 11


# --- an independent map of a GGUF file's fields (offsets of what to corrupt) ----

_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


def gguf_fields(data: bytes):
    """[(label, offset, struct format)] of every count, length, type, shape and
    offset field of a well-formed GGUF (v3), plus where the tensor table starts."""
    fields = [("version", 4, "<I"), ("n_tensors", 8, "<Q"), ("n_kv", 16, "<Q")]
    n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
    pos = 24

    def string(label):
        nonlocal pos
        fields.append((f"{label} length", pos, "<Q"))
        n = struct.unpack_from("<Q", data, pos)[0]
        pos += 8 + n

    def value(vtype, label):
        nonlocal pos
        if vtype == 8:
            string(label)
        elif vtype == 9:
            fields.append((f"{label} item type", pos, "<I"))
            fields.append((f"{label} count", pos + 4, "<Q"))
            itype, count = struct.unpack_from("<IQ", data, pos)
            pos += 12
            for i in range(count):
                if itype == 8 and i < 3:
                    string(f"{label}[{i}]")
                elif itype == 8:
                    pos += 8 + struct.unpack_from("<Q", data, pos)[0]
                else:
                    pos += _SIZES[itype]
        else:
            fields.append((f"{label} value", pos, "<" + "BbHhIifB??Qqd"[vtype]))
            pos += _SIZES[vtype]

    for k in range(n_kv):
        n = struct.unpack_from("<Q", data, pos)[0]
        key = data[pos + 8 : pos + 8 + n].decode()
        string(f"key {key}")
        fields.append((f"{key} type", pos, "<I"))
        vtype = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        value(vtype, key)
    table = pos
    for t in range(n_tensors):
        string(f"tensor {t} name")
        fields.append((f"tensor {t} ndim", pos, "<I"))
        ndim = struct.unpack_from("<I", data, pos)[0]
        pos += 4
        for d in range(ndim):
            fields.append((f"tensor {t} dim {d}", pos, "<Q"))
            pos += 8
        fields.append((f"tensor {t} type", pos, "<I"))
        fields.append((f"tensor {t} offset", pos + 4, "<Q"))
        pos += 12
    return fields, table, pos


def _put(data: bytes, pos: int, fmt: str, value) -> bytes:
    out = bytearray(data)
    size = struct.calcsize(fmt)
    if fmt[-1] in "fd":
        struct.pack_into(fmt, out, pos, value)
    else:  # wrap into the field's width: huge, negative and zero all fit
        struct.pack_into(fmt.upper(), out, pos, value % (1 << (8 * size)))
    return bytes(out)


def gguf_cases(base: bytes, rng: random.Random):
    """(label, bytes) of mutated GGUF files."""
    fields, table, header_end = gguf_fields(base)
    yield "magic and junk", b"GGUF" + rng.randbytes(200)
    for i in range(4):
        yield f"magic, v3, junk {i}", b"GGUF\x03\x00\x00\x00" + rng.randbytes(300)
    yield "empty", b""
    yield "magic only", b"GGUF"
    cuts = sorted(rng.sample(range(1, header_end), 30))
    cuts += sorted(rng.sample(range(header_end, len(base)), 6))
    for cut in cuts:
        yield f"truncated at {cut}", base[:cut]
    for label, pos, fmt in fields:
        if fmt in ("<B", "<b", "<?"):
            continue
        for value in (0, 2**63 + 5, -1, rng.randrange(1, 1 << 16)):
            if fmt[-1] in "fd":
                value = float(value)
            if rng.random() < 0.25 or label.startswith(("n_", "version", "tensor 0")):
                yield f"{label} = {value}", _put(base, pos, fmt, value)
    for t in range(32):  # every GGML type id on the first tensor
        pos = next(p for lab, p, _ in fields if lab == "tensor 0 type")
        yield f"tensor 0 type {t}", _put(base, pos, "<I", t)
    for i in range(25):
        data = bytearray(base)
        for _ in range(rng.randrange(1, 9)):
            data[rng.randrange(4, header_end)] = rng.randrange(256)
        yield f"header bytes flipped {i}", bytes(data)
    for i in range(4):
        data = bytearray(base)
        for _ in range(64):
            data[rng.randrange(header_end, len(data))] = rng.randrange(256)
        yield f"tensor data flipped {i}", bytes(data)


def safetensors_cases(base: bytes, rng: random.Random):
    """(label, bytes) of mutated safetensors files."""
    n = struct.unpack_from("<Q", base)[0]
    header = json.loads(base[8 : 8 + n])
    data = base[8 + n :]

    def build(h, pad_to=None):
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + data

    yield "empty", b""
    yield "seven bytes", base[:7]
    for cut in sorted(rng.sample(range(8, len(base)), 20)):
        yield f"truncated at {cut}", base[:cut]
    for value in (0, 1, n - 1, n + 1, len(base), 2**63, 2**64 - 1):
        yield f"header length {value}", struct.pack("<Q", value) + base[8:]
    yield "header not JSON", struct.pack("<Q", 8) + b"not json" + data
    yield "header a list", build([1, 2])
    yield "header not UTF-8", struct.pack("<Q", 4) + b"\xff\xfe\xfd\xfc" + data
    names = [k for k in header if k != "__metadata__"]
    name = names[0]
    bad_entries = {
        "dtype F64x": {"dtype": "F64x"},
        "dtype null": {"dtype": None},
        "dtype I8": {"dtype": "I8"},
        "dtype F16": {"dtype": "F16"},
        "shape string": {"shape": "64"},
        "shape negative": {"shape": [-1, 64]},
        "shape huge": {"shape": [2**40, 2**40]},
        "shape float": {"shape": [1.5, 64]},
        "shape empty": {"shape": []},
        "shape zero": {"shape": [0, 64]},
        "offsets reversed": {"data_offsets": [100, 0]},
        "offsets past end": {"data_offsets": [0, len(data) + 4]},
        "offsets negative": {"data_offsets": [-4, 0]},
        "offsets string": {"data_offsets": ["0", "4"]},
        "offsets one": {"data_offsets": [0]},
        "offsets huge": {"data_offsets": [2**64, 2**64 + 4]},
    }
    for label, change in bad_entries.items():
        for which in (name, rng.choice(names)):
            h = json.loads(json.dumps(header))
            h[which].update(change)
            yield f"{which}: {label}", build(h)
    for label, change in {
        "entry a list": [1],
        "entry null": None,
        "entry empty": {},
    }.items():
        h = dict(header)
        h[name] = change
        yield label, build(h)
    for meta in ({"a": 1}, [1], "x"):
        yield f"__metadata__ {meta!r}", build({**header, "__metadata__": meta})
    h = dict(header)
    del h[name]
    yield "tensor missing", build(h)
    for i in range(15):
        raw = bytearray(base)
        for _ in range(rng.randrange(1, 6)):
            raw[rng.randrange(8, 8 + n)] = rng.randrange(32, 127)
        yield f"header bytes flipped {i}", bytes(raw)


BAD_VALUES = [None, "abc", -1, 0, 1.5, 2**40, [], {}, True, float("nan"), -0.0]


def config_cases(config: dict, rng: random.Random):
    """(label, text) of mutated config.json files."""
    yield "empty", ""
    yield "not JSON", "{model_type: llama"
    yield "a list", "[1, 2]"
    yield "a string", '"llama"'
    yield "not UTF-8", "\udcff"
    for key in config:
        for value in BAD_VALUES:
            if rng.random() < 0.6 or key in ("hidden_size", "num_hidden_layers"):
                yield f"{key} = {value!r}", json.dumps({**config, key: value})
        yield f"no {key}", json.dumps({k: v for k, v in config.items() if k != key})
    extras = {
        "head_dim": [7, 0, "x", 10**9],
        "rope_scaling": [
            {"type": "linear", "factor": -2.0},
            {"type": "linear", "factor": "x"},
            {"rope_type": "llama3", "factor": 8.0},
            {"type": "yarn"},
            "linear",
            [1],
        ],
        "quantization": [
            {"bits": 4, "group_size": 64},
            {"bits": 7, "group_size": 64},
            {"bits": 4, "group_size": 48},
            {"bits": "4", "group_size": 64},
            {"bits": 4},
            "4bit",
            {"bits": 4, "group_size": 64, "model.layers.0.mlp.up_proj": 3},
        ],
        "flashnorm": [{"folded": True}, {"folded": "yes"}, "folded", [1]],
        "layer_types": [["full_attention"], "full", [1, 2]],
        "sliding_window": [0, -5, "x", 3],
        "num_key_value_heads": [3, 8],
    }
    for key, values in extras.items():
        for value in values:
            yield f"{key} = {value!r}", json.dumps({**config, key: value})


def openelm_config_cases(config: dict, rng: random.Random):
    for key in ("num_query_heads", "num_kv_heads", "ffn_multipliers"):
        for value in ([1], [0, 0], [-1, 2], ["a", "b"], 3, None, [2**40, 1]):
            yield f"openelm {key} = {value!r}", json.dumps({**config, key: value})
    for key in ("model_dim", "head_dim", "num_transformer_layers", "ffn_dim_divisor"):
        for value in (0, -3, "x", None, 2**31):
            yield f"openelm {key} = {value!r}", json.dumps({**config, key: value})


# --- the run -------------------------------------------------------------------


def _cases(root: Path):
    """[{id, label, argv, file}]: every mutated input written under root."""
    rng = random.Random(SEED)
    cfg = tiny.llama_config("gqa_untied")
    weights = tiny.llama_weights(cfg, seed=3)
    base_gguf = write_tiny_gguf(root / "base.gguf", cfg, weights).read_bytes()
    llama = tiny.write_model(root / "llama", cfg, weights, tokenizer=False)
    openelm = tiny.make_openelm(root / "openelm", "shared")
    cases = []

    def add(label, argv, file):
        cases.append(dict(id=len(cases), label=label, argv=argv, file=file))

    for label, data in gguf_cases(base_gguf, rng):
        path = root / f"g{len(cases)}.gguf"
        path.write_bytes(data)
        add(f"gguf: {label}", ["verify", str(path), *ARGS], path.name)

    def folder(src: Path, name: str, **files) -> Path:
        """A model folder: the given files written, the others linked to src's."""
        out = root / f"{name}{len(cases)}"
        out.mkdir()
        for f in ("config.json", "model.safetensors"):
            if f in files:
                data = files[f]
                (out / f).write_bytes(
                    data if isinstance(data, bytes) else data.encode()
                )
            else:
                (out / f).symlink_to(src / f)
        return out

    base_st = (llama / "model.safetensors").read_bytes()
    for label, data in safetensors_cases(base_st, rng):
        path = folder(llama, "s", **{"model.safetensors": data})
        add(f"safetensors: {label}", ["verify", str(path), *ARGS], "model.safetensors")
    for label, text in config_cases(cfg, rng):
        text = text.encode("utf-8", "surrogateescape")
        path = folder(llama, "c", **{"config.json": text})
        add(f"config: {label}", ["verify", str(path), *ARGS], "config.json")
    ocfg = json.loads((openelm / "config.json").read_text())
    for label, text in openelm_config_cases(ocfg, rng):
        path = folder(openelm, "o", **{"config.json": text})
        add(f"config: {label}", ["verify", str(path), *ARGS], "config.json")
    return cases


def _run_all(cases, work: Path, timeout: float = 240.0):
    """{id: result}; a case that kills the child is re-run alone to confirm."""
    (work / "cases.json").write_text(json.dumps(cases))
    log = work / "results.jsonl"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    crashes = {}
    for _ in range(len(cases) + 1):
        child = subprocess.run(
            [
                sys.executable,
                str(HERE / "fuzz_child.py"),
                str(work / "cases.json"),
                str(log),
            ],
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
        rows = [json.loads(line) for line in log.read_text().splitlines()]
        started = {r["id"] for r in rows if r.get("started")}
        finished = {r["id"] for r in rows if not r.get("started")}
        lost = sorted(started - finished - set(crashes))
        if child.returncode == 0 and not lost:
            break
        assert (
            lost
        ), f"child failed outside a case: rc {child.returncode}\n{child.stderr}"
        case = cases[lost[0]]
        alone = subprocess.run(
            [sys.executable, "-m", "flashnorm_mlx", *case["argv"]],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        crashes[case["id"]] = dict(
            id=case["id"],
            rc=alone.returncode,
            stderr=alone.stderr,
            stdout=alone.stdout,
            traceback=None,
            crashed_child=child.returncode,
        )
    results = {r["id"]: r for r in rows if not r.get("started")}
    results.update(crashes)
    return results


def _verdict(case, r) -> str:
    """'' when the case behaved, else what went wrong."""
    if r is None:
        return "no result"
    if r.get("crashed_child") is not None:
        return f"killed the process (child rc {r['crashed_child']}, alone rc {r['rc']})"
    if r["traceback"]:
        return "traceback: " + r["traceback"].strip().splitlines()[-1]
    err = r["stderr"].strip().splitlines()
    if r["rc"] == 0:
        try:
            report = json.loads(r["stdout"])
        except ValueError:
            return f"exit 0 without a report: {r['stdout'][-200:]!r}"
        return "" if "max_abs_logit_diff" in report else "exit 0, report incomplete"
    if r["rc"] != 1:
        return f"exit {r['rc']}: {r['stderr'][-300:]!r}"
    if r["stdout"].startswith('{"') and '"verdict": "FAIL: ' in r["stdout"]:
        return ""  # it ran, and verify's verdict said FAIL (exit 1): a report
    if len(err) != 1 or not err[0].startswith("flashnorm-mlx: error: "):
        return f"not one error line: {r['stderr'][-400:]!r}"
    if case["file"] not in err[0] and Path(case["argv"][1]).name not in err[0]:
        return f"the error does not name the file: {err[0]!r}"
    return ""


def test_fuzzed_model_files_never_crash(tmp_path):
    cases = _cases(tmp_path)
    assert len(cases) >= 300, len(cases)
    results = _run_all(cases, tmp_path)
    bad = [
        f"{c['label']}: {v}" for c in cases if (v := _verdict(c, results.get(c["id"])))
    ]
    outcome = {0: 0, 1: 0}
    for r in results.values():
        outcome[r["rc"]] = outcome.get(r["rc"], 0) + 1
    assert not bad, f"{len(bad)} of {len(cases)} cases misbehaved " + json.dumps(
        bad[:40], indent=1
    )
    # Most mutations must be refused, not silently run on: proves the checks bite.
    assert outcome[1] > 0.6 * len(cases), outcome


def test_gguf_magic_then_junk_is_one_line_through_the_entry_point(tmp_path):
    # The reproduction: this killed the process with SIGSEGV (exit 139).
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"GGUF" + random.Random(0).randbytes(200))
    r = subprocess.run(
        [sys.executable, "-m", "flashnorm_mlx", "verify", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    err = r.stderr.strip().splitlines()
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert len(err) == 1 and "junk.gguf" in err[0] and "GGUF" in err[0], r.stderr


def test_gguf_check_reads_the_table_mlx_reads(tmp_path):
    # A well-formed file passes, and the walk finds what MLX's own reader finds.
    from flashnorm_mlx.loading.checks import check_gguf

    cfg = tiny.llama_config("mha_tied")
    path = write_tiny_gguf(tmp_path / "ok.gguf", cfg, tiny.llama_weights(cfg))
    ours = {t.name: tuple(reversed(t.shape)) for t in check_gguf(path)}
    theirs = {k: tuple(v.shape) for k, v in mx.load(str(path)).items()}
    assert ours == theirs, (ours, theirs)
