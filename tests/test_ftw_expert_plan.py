"""Per-expert formats in FTW conversion (freetoken/convert/expert_plan.py): the hot/cold policy takes exactly each
layer's most routed experts of a recorded routing trace; the error-budget policy takes the first candidate within
the budget (recomputed here with the formats' own codecs); a planned file holds every record in its planned format,
bit for bit what the source's banks in that format give, with valid checksums; the CLI refuses partial and
conflicting flag sets by name and prints the plan before writing. (Loading a file that mixes formats inside a layer
is not tested here: the runtime for it is being built.)"""

import numpy as np
import pytest

from freetoken import formats
from freetoken.cli import main
from freetoken.convert.expert_plan import (
    DEFAULT_CANDIDATES,
    counts_from_trace,
    error_budget_plan,
    format_layouts,
    hot_cold_plan,
    moe_layer_ids,
    nmse,
    plan_summary,
)
from freetoken.convert.ftw_export import write_ftw
from freetoken.engine.loading.load import DEFAULT_MODEL
from freetoken.engine.loading.sources import open_source
from freetoken.formats import ALIGNMENT, MATRICES
from freetoken.loaders.ftw_file import RECORD_HEADER_BYTES, FTWFile, checksum, record_header
from freetoken.trace.format import load_trace, save_trace
from freetoken.trace.synthetic import make_trace


@pytest.fixture(scope="module")
def src():
    return open_source(None)  # the bundled model: 6 MoE layers of 16 experts, hidden 192, moe_inter 96


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory):
    """A routing trace recorded from the bundled model the way users record one."""
    path = tmp_path_factory.mktemp("trace") / "t.npz"
    assert main(["run", "--device", "cpu", "--max-tokens", "6", "--record-trace", str(path),
                 "def main():\n    return"]) == 0
    return path


# ---- hot/cold ----------------------------------------------------------------------------------------------
def test_hot_cold_plan_takes_each_layers_top_experts():
    counts = np.array([[5, 1, 5, 0],    # a tie at the top: both hot
                       [0, 0, 0, 0],    # all tied: the lowest ids
                       [1, 2, 3, 4],
                       [7, 3, 3, 3]])   # a tie at the cut: the lower id wins
    plan = hot_cold_plan(counts, "bf16", "q4_0", 0.5)
    hot = [{e for e, f in enumerate(row) if f == "bf16"} for row in plan]
    assert hot == [{0, 2}, {0, 1}, {2, 3}, {0, 1}]
    assert all(f in ("bf16", "q4_0") for row in plan for f in row)
    one = hot_cold_plan(counts, "bf16", "q4_0", 0.3)  # 1.2 experts -> 1
    assert [row.index("bf16") for row in one] == [0, 0, 3, 0] and all(row.count("bf16") == 1 for row in one)
    assert [row.count("bf16") for row in hot_cold_plan(counts, "bf16", "q4_0", 0.375)] == [2] * 4  # 1.5: half up
    assert hot_cold_plan(counts, "bf16", "q4_0", 0.0) == [["q4_0"] * 4] * 4
    assert hot_cold_plan(counts, "bf16", "q4_0", 1.0) == [["bf16"] * 4] * 4


@pytest.mark.parametrize("args, match", [
    ((np.ones((2, 4)), "bf16", "q4_0", 1.5), "hot fraction"),
    ((np.ones((2, 4)), "bf16", "q4_0", -0.1), "hot fraction"),
    ((np.ones((2, 4)), "bf17", "q4_0", 0.5), "unknown expert format 'bf17'"),
    ((np.ones(4), "bf16", "q4_0", 0.5), r"\[moe_layers, experts\]"),
])
def test_hot_cold_plan_refuses_bad_input(args, match):
    with pytest.raises(ValueError, match=match):
        hot_cold_plan(*args)


def test_counts_from_a_recorded_trace(trace_path, src):
    counts = counts_from_trace(trace_path, 6, 16)
    t = load_trace(trace_path)
    assert counts.shape == (6, 16) and t.steps > 0  # prefill and decode both present
    want = t.prefill_counts.sum(axis=0).astype(np.int64)
    for layer in range(6):
        want[layer] += np.bincount(t.decode_ids[:, layer].ravel(), minlength=16)
    np.testing.assert_array_equal(counts, want)
    # every routed token counts top_k times in every layer: prompt tokens plus decode steps
    prompt_tokens = int(t.prefill_counts[:, 0].sum()) // t.top_k
    assert (counts.sum(axis=1) == (prompt_tokens + t.steps * t.tokens) * t.top_k).all()


@pytest.mark.parametrize("layers, experts", [(5, 16), (6, 32)])
def test_counts_from_a_trace_of_another_model_are_refused(trace_path, layers, experts):
    with pytest.raises(ValueError, match="another model") as e:
        counts_from_trace(trace_path, layers, experts)
    assert str(trace_path) in str(e.value)


# ---- writing a plan ----------------------------------------------------------------------------------------
def _payload(banks: dict, layout, e: int) -> bytes:
    """Expert ``e``'s record payload as docs/ftw.md lays it out: each bank row padded to 16 bytes."""
    out = b""
    for s in layout.bank_specs():
        row = np.ascontiguousarray(banks[s.name][e]).tobytes()
        out += row + b"\0" * (-len(row) % ALIGNMENT)
    return out


def test_a_hot_cold_file_holds_each_record_in_its_planned_format(src, trace_path, tmp_path):
    counts = counts_from_trace(trace_path, 6, 16)
    plan = hot_cold_plan(counts, "fp8_block", "mxfp4", 0.25)
    assert all(row.count("fp8_block") == 4 for row in plan)
    out = write_ftw(src, tmp_path / "mixed.ftw", expert_plan=plan)
    ftw = FTWFile(out, verify="full")
    moe = moe_layer_ids(src.cfg)
    layouts = format_layouts(src.cfg, ["fp8_block", "mxfp4"])
    raw = out.read_bytes()
    for i, layer in enumerate(moe):
        banks = {f: src.weights.expert_banks(layer, lay) for f, lay in layouts.items()}
        for e in range(16):
            r = ftw.records[(layer, e)]
            assert (r.fmt, r.down_fmt) == (plan[i][e], plan[i][e])
            want = _payload(banks[plan[i][e]], layouts[plan[i][e]], e)
            assert r.nbytes == RECORD_HEADER_BYTES + len(want)
            assert bytes(ftw.record_payload(layer, e)) == want  # header vs index and checksum checked too
            head = raw[r.offset:r.offset + RECORD_HEADER_BYTES]
            assert head[:48] == record_header(plan[i][e], plan[i][e], False, layer, e, len(want))
            assert head[48:] == bytes.fromhex(r.xxh3) and checksum(head[:48], want) == r.xxh3
    assert {(r.fmt, r.down_fmt) for r in ftw.records.values()} == {("fp8_block",) * 2, ("mxfp4",) * 2}


def test_a_uniform_plan_writes_the_same_file_as_expert_format(src, tmp_path):
    a = write_ftw(src, tmp_path / "a.ftw", expert_format="q4_0")
    b = write_ftw(src, tmp_path / "b.ftw", expert_plan=[["q4_0"] * 16 for _ in range(6)])
    assert a.read_bytes() == b.read_bytes()


@pytest.mark.parametrize("kwargs, match", [
    ({"expert_format": "q4_0", "expert_plan": [["q4_0"] * 16] * 6}, "not both"),
    ({"expert_plan": [["q4_0"] * 16] * 5}, "5 layers, the model has 6 MoE layers"),
    ({"expert_plan": [["q4_0"] * 15] + [["q4_0"] * 16] * 5}, "MoE layer 0 has 15 entries for 16 experts"),
    ({"expert_plan": [["q4_0"] * 15 + ["f32"]] + [["q4_0"] * 16] * 5}, r"unknown formats \['f32'\]"),
    ({"expert_plan": [["q4_0"] * 15 + ["q4_k"]] + [["q4_0"] * 16] * 5}, "q4_k needs K"),
])
def test_a_bad_plan_is_refused_and_writes_nothing(src, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        write_ftw(src, tmp_path / "x.ftw", **kwargs)
    assert list(tmp_path.iterdir()) == []


# ---- error budget ------------------------------------------------------------------------------------------
CANDIDATES = list(DEFAULT_CANDIDATES)


@pytest.fixture(scope="module")
def measured(src):
    """NMSE [moe layer, expert] of every candidate, recomputed with the formats' codecs on the checkpoint's floats
    (worst of gate, up and down)."""
    out = {}
    for f in CANDIDATES:
        fmt = formats.get(f)
        rows = []
        for layer in moe_layer_ids(src.cfg):
            per_matrix = []
            for m in MATRICES:
                w = src.weights.expert_stack(layer, m)
                d = fmt.dequantize(fmt.quantize(w)).astype(np.float64)
                per_matrix.append(((d - w) ** 2).sum(axis=(1, 2)) / (w.astype(np.float64) ** 2).sum(axis=(1, 2)))
            rows.append(np.max(per_matrix, axis=0))
        out[f] = np.array(rows)
    return out


def test_error_budget_extremes(src):
    layouts = format_layouts(src.cfg, CANDIDATES)
    moe = moe_layer_ids(src.cfg)
    assert error_budget_plan(src.weights, layouts, moe, 1e9, CANDIDATES) == [["mxfp4"] * 16] * 6
    assert error_budget_plan(src.weights, layouts, moe, 0.0, CANDIDATES) == [["bf16"] * 16] * 6
    with pytest.raises(ValueError, match="finite number >= 0"):
        error_budget_plan(src.weights, layouts, moe, -1.0, CANDIDATES)


def test_error_budget_takes_the_first_candidate_within_it(src, measured):
    assert measured["bf16"].max() == 0.0  # the checkpoint is bf16: bf16 is exact
    # budgets inside the spread of mxfp4's and of q4_0's errors: some experts take each
    for budget in (float(np.median(measured["mxfp4"])), float(np.median(measured["q4_0"]))):
        plan = error_budget_plan(src.weights, format_layouts(src.cfg, CANDIDATES), moe_layer_ids(src.cfg), budget,
                                 CANDIDATES)
        chosen = {f for row in plan for f in row}
        assert len(chosen) >= 2, (budget, chosen)
        for i, row in enumerate(plan):
            for e, f in enumerate(row):
                k = CANDIDATES.index(f)
                assert measured[f][i, e] <= budget or k == len(CANDIDATES) - 1
                if k:
                    assert measured[CANDIDATES[k - 1]][i, e] > budget


def test_nmse_of_an_exact_and_of_an_empty_expert():
    w = np.zeros((2, 3, 4), np.float32)
    w[0] = 1.0
    assert nmse(w, w).tolist() == [0.0, 0.0]
    assert nmse(w + 1, w).tolist() == [1.0, np.inf]


def test_plan_summary(src):
    layouts = format_layouts(src.cfg, ["fp8_block", "mxfp4"])
    plan = [["fp8_block"] * 4 + ["mxfp4"] * 12 for _ in range(6)]
    bits = [layouts[f].record_bytes * 8 / (3 * 192 * 96) for f in ("fp8_block", "mxfp4")]
    line = plan_summary(plan, layouts)
    assert "\n" not in line
    assert "24 fp8_block, 72 mxfp4 (96 experts in 6 MoE layers)" in line
    assert f"{(bits[0] * 24 + bits[1] * 72) / 96:.2f} bits per expert weight" in line


# ---- the command line --------------------------------------------------------------------------------------
def _error(capsys, rc) -> str:
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and "freetoken convert: error:" in lines[0] and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("flags, out, expected", [
    (["--hot", "fp8_block", "--cold", "mxfp4"], "o.ftw", "needs --hot-fraction, --trace too"),
    (["--trace", "T"], "o.ftw", "needs --hot, --cold, --hot-fraction too"),
    (["--hot", "fp8_block", "--cold", "mxfp4", "--hot-fraction", "0.5", "--trace", "T", "--max-nmse", "0.01"],
     "o.ftw", "--hot/--cold and --max-nmse are exclusive"),
    (["--max-nmse", "0.01", "--expert-format", "q4_0"], "o.ftw", "--max-nmse and --expert-format are exclusive"),
    (["--hot", "bf16", "--cold", "q4_0", "--hot-fraction", "0.5", "--trace", "T", "--expert-format", "q4_0"],
     "o.ftw", "--hot/--cold and --expert-format are exclusive"),
    (["--candidates", "q4_0,bf16"], "o.ftw", "--candidates needs --max-nmse"),
    (["--max-nmse", "0.01"], "o.gguf", "--max-nmse is for .ftw outputs"),
    (["--expert-format", "q4_0"], "o.gguf", "--expert-format is for .ftw outputs"),
    (["--max-nmse", "0.01", "--candidates", "q4_0,f32"], "o.ftw", "argument --candidates"),
    (["--max-nmse", "-1"], "o.ftw", "argument --max-nmse"),
    (["--hot", "bf16", "--cold", "q4_0", "--hot-fraction", "2", "--trace", "T"], "o.ftw",
     "argument --hot-fraction"),
])
def test_cli_refuses_partial_and_conflicting_flags(tmp_path, capsys, flags, out, expected):
    line = _error(capsys, main(["convert", str(DEFAULT_MODEL), str(tmp_path / out), *flags]))
    assert expected in line, line
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_a_trace_of_another_model(tmp_path, capsys):
    other = tmp_path / "other.npz"
    save_trace(other, make_trace(num_layers=4, num_experts=16, steps=5, segments=1))
    line = _error(capsys, main(["convert", str(DEFAULT_MODEL), str(tmp_path / "o.ftw"), "--hot", "fp8_block",
                                "--cold", "mxfp4", "--hot-fraction", "0.25", "--trace", str(other)]))
    assert str(other) in line and "another model" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.npz"]


def test_cli_hot_cold_conversion_prints_the_plan(trace_path, tmp_path, capsys):
    out = tmp_path / "hc.ftw"
    assert main(["convert", str(DEFAULT_MODEL), str(out), "--hot", "fp8_block", "--cold", "mxfp4",
                 "--hot-fraction", "0.25", "--trace", str(trace_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("expert plan: 24 fp8_block, 72 mxfp4 (96 experts in 6 MoE layers); ")
    assert "bits per expert weight on average" in lines[0] and lines[1].startswith(f"wrote {out}")
    plan = hot_cold_plan(counts_from_trace(trace_path, 6, 16), "fp8_block", "mxfp4", 0.25)
    ftw = FTWFile(out)
    assert [[ftw.records[(layer, e)].fmt for e in range(16)] for layer in range(6)] == plan


def test_cli_error_budget_conversion(tmp_path, capsys):
    out = tmp_path / "eb.ftw"
    assert main(["convert", str(DEFAULT_MODEL), str(out), "--max-nmse", "1e9", "--candidates", "q4_0,bf16"]) == 0
    assert capsys.readouterr().out.startswith("expert plan: 96 q4_0 (96 experts in 6 MoE layers); 4.50 bits")
    assert {r.fmt for r in FTWFile(out).records.values()} == {"q4_0"}
