"""converters.megatron_pipeline against megatron-core's own split (get_transformer_layer_offset and
get_num_layers_to_build, over its TransformerConfig's checks), and Megatron's virtual and uneven pipelines end to
end: megatron-core 0.16.1 trains on 2 gloo processes, saves, and loads what we write."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from converters.megatron_pipeline import PipelineSplit
from interop.errors import ConversionError
from tests.conftest import ROOT, run_workers, worker_env


GRID = list(itertools.product(range(1, 13), (1, 2, 3, 4), (1, 2, 3), (None, 0, 1, 2, 4), (None, 1, 2, 3), (False, True), (False, True)))


def test_pipeline_split_is_megatron_cores():
    """Every setting of the grid (layers, PP, VPP, first / last stage layers, embedding / loss accounted): the same
    layers in every chunk as megatron-core builds (run in a process of its own: importing megatron-core widens
    torch's weights_only allowlist), and refused exactly where megatron-core cannot build the split."""
    pytest.importorskip("megatron.core")
    done = subprocess.run([sys.executable, "-m", "tests.mcore_pipeline_worker", "grid"], input=json.dumps(GRID), capture_output=True,
                          text=True, env=worker_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    theirs = json.loads(done.stdout)
    built = 0
    for setting, split in zip(GRID, theirs):
        try:
            ours = [[[r.start, len(r)] for r in stage] for stage in PipelineSplit(*setting).chunks()]
        except ConversionError:
            ours = None
        assert ours == split, setting
        built += ours is not None
    assert built > 300  # the grid holds a few hundred settings megatron-core builds


def _layouts(count: int, seed: int = 0) -> list[tuple[int, int, str]]:
    """(layers, PP, --pipeline-model-parallel-layout) settings: "E", the layers and "L" cut into PP x V segments
    anywhere (empty segments included), written with megatron-core's shorthands ("t*3", "(tt|)*2", commas), and
    damaged copies (a layer too many or too few, E or L misplaced or twice, an MTP layer, a foreign character)."""
    import random

    rng = random.Random(seed)
    out = [(62, 16, "Et*3|(tt|)*29,t|L"), (61, 16, "Et*3|(tt|)*29,m|L"), (2, 2, "E||tt|L"), (1, 1, "EtL"), (2, 1, "Et|tL")]
    while len(out) < count:
        n, pp, vpp = rng.randint(1, 6), rng.randint(1, 4), rng.randint(1, 3)
        flat = "E" + "t" * n + "L"
        cuts = sorted(rng.randint(0, len(flat)) for _ in range(pp * vpp - 1))
        segments = [flat[a:b] for a, b in zip([0, *cuts], [*cuts, len(flat)])]
        damage = rng.choice(["", "", "", "t+", "t-", "E", "L", "m", "x", "EE"])
        if damage == "t+":
            segments[rng.randrange(len(segments))] += "t"
        elif damage == "t-" and "tt" in "".join(segments):
            i = next(i for i, g in enumerate(segments) if "t" in g)
            segments[i] = segments[i].replace("t", "", 1)
        elif damage in ("E", "L"):  # moved to another segment
            i = next(i for i, g in enumerate(segments) if damage in g)
            segments[i] = segments[i].replace(damage, "")
            segments[rng.randrange(len(segments))] += damage
        elif damage in ("m", "x", "EE"):
            segments[-1] = damage[0] + segments[-1]
        text = "|".join(g.replace("ttt", "t*3") if rng.random() < 0.3 else g for g in segments)
        if rng.random() < 0.2 and len(set(segments[1:-1])) == 1 and len(segments) > 3:  # the middle as one repeat
            text = f"{segments[0]}|({segments[1]}|)*{len(segments) - 2},{segments[-1]}"
        if rng.random() < 0.2:
            text = ",".join(text)
        out.append((n, pp, text))
    return out


LAYOUTS = _layouts(1500)


def test_pipeline_layout_is_megatron_cores():
    """--pipeline-model-parallel-layout strings (megatron-core's syntax, shorthands and empty segments included, and
    damaged ones): the same layers in every chunk as megatron-core builds from its TransformerConfig, and refused
    exactly where it (or Megatron-LM's argument checks) refuses the string."""
    pytest.importorskip("megatron.core")
    done = subprocess.run([sys.executable, "-m", "tests.mcore_pipeline_worker", "layout-grid"], input=json.dumps(LAYOUTS),
                          capture_output=True, text=True, env=worker_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    built = 0
    for (n, pp, layout), split in zip(LAYOUTS, json.loads(done.stdout)):
        args = {"num_layers": n, "pipeline_model_parallel_size": pp, "pipeline_model_parallel_layout": layout}
        try:
            ours = [[[r.start, len(r)] for r in stage] for stage in PipelineSplit.from_args(args, "x").chunks()]
        except ConversionError:
            ours = None
        assert ours == split, (n, pp, layout)
        built += ours is not None
    assert 300 < built < len(LAYOUTS) - 300  # both kinds, many of each


def test_pipeline_split_from_args_reads_megatron_lm_names():
    args = {"num_layers": 6, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
            "decoder_first_pipeline_num_layers": 2}
    split = PipelineSplit.from_args(args, "common.pt")
    assert split.chunks() == [[range(0, 1), range(3, 4)], [range(1, 3), range(4, 6)]]
    assert PipelineSplit.from_args({**args, **split.to_args()}, "x") == split
    layout = {**args, "virtual_pipeline_model_parallel_size": None, "decoder_first_pipeline_num_layers": None,
              "pipeline_model_parallel_layout": "Et|t*2|tt|t,L"}
    split = PipelineSplit.from_args(layout, "common.pt")
    assert split.chunks() == [[range(0, 1), range(3, 5)], [range(1, 3), range(5, 6)]]
    assert split.flags() == {"pipeline_model_parallel_layout": "Et|t*2|tt|t,L"}
    assert PipelineSplit.from_args({**args, **split.to_args()}, "x") == split
    with pytest.raises(ConversionError, match=r"^common.pt: --pipeline-model-parallel-layout takes no other pipeline split flag"):
        PipelineSplit.from_args({**layout, "decoder_first_pipeline_num_layers": 2}, "common.pt")
    with pytest.raises(ConversionError, match="do not split evenly over 3 virtual stages"):
        PipelineSplit(6, 2, 3, first=2)


@pytest.mark.parametrize("hostile", [
    {"virtual_pipeline_model_parallel_size": 10**12}, {"pipeline_model_parallel_size": 10**12}, {"pipeline_model_parallel_size": -1},
    {"num_layers_per_virtual_pipeline_stage": 3}, {"virtual_pipeline_model_parallel_size": "two"}, {"decoder_first_pipeline_num_layers": -1},
    {"decoder_first_pipeline_num_layers": True}, {"num_layers": None}, {"decoder_last_pipeline_num_layers": [1]},
    {"pipeline_model_parallel_layout": "E(t|)*99999999999|tttL"}, {"num_layers": 10**9, "pipeline_model_parallel_layout": "E(t|)*999999999|L"}, {"pipeline_model_parallel_layout": "Et*" + "9" * 5000 + "|L"},
    {"pipeline_model_parallel_layout": ["E", "tttt", "L"]}, {"pipeline_model_parallel_layout": "Et|tt|t|L", "virtual_pipeline_model_parallel_size": 3},
])
def test_pipeline_split_from_hostile_args_is_one_error(hostile):
    """A checkpoint's args are not trusted: any value is refused as one ConversionError naming the file, before a
    list of its size is built."""
    args = {"num_layers": 4, "pipeline_model_parallel_size": 2, **hostile}
    with pytest.raises(ConversionError, match=r"^common\.pt: "):
        PipelineSplit.from_args(args, "common.pt")


# --- megatron-core's own runs ------------------------------------------------------------------------------------
megatron_core = pytest.mark.skipif(
    importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
    reason="megatron-core is the optional test extra 'megatron' (pip install -e '.[test,megatron]', Python 3.11)")
WORKER = str(ROOT / "tests" / "mcore_pipeline_worker.py")
# each a run of megatron-core's: TP1 x PP2 on 2 processes
INTERLEAVED = {"MCORE_LAYERS": "4", "MCORE_VPP": "2"}  # stage 0 holds layers 0 and 2, stage 1 layers 1 and 3
UNEVEN = {"MCORE_LAYERS": "3", "MCORE_FIRST": "1"}  # stage 0 holds layer 0, stage 1 layers 1 and 2
# 3 layers and the embedding in 4 chunks: stage 0's first chunk holds the embedding alone, no layer
ACCOUNTED = {"MCORE_LAYERS": "3", "MCORE_VPP": "2", "MCORE_ACCOUNT": "embedding"}
# a MoE model interleaved, experts over 2 expert-parallel ranks (4 processes: TP1 x PP2 x DP2, EP2)
MOE = {**INTERLEAVED, "MCORE_EXPERTS": "4", "MCORE_EP": "2"}
# --pipeline-model-parallel-layout: stage 0 holds layers 0, 2 and 3 (chunks [E t] and [t t]), stage 1 layer 1 and a
# last chunk of the final norm and the head alone; and a layout with an empty chunk (stage 1's first)
LAYOUT = {"MCORE_LAYERS": "4", "MCORE_VPP": "2", "MCORE_LAYOUT": "Et|t|tt|L"}
LAYOUT_EMPTY = {"MCORE_LAYERS": "4", "MCORE_VPP": "2", "MCORE_LAYOUT": "Et*2||t*2|L"}
SPLITS = {"interleaved": INTERLEAVED, "uneven": UNEVEN, "accounted": ACCOUNTED, "moe-interleaved": MOE, "layout": LAYOUT,
          "layout-empty": LAYOUT_EMPTY}
SPLIT_FLAGS = {"interleaved": ["--num-virtual-stages-per-pipeline-rank", "2"], "uneven": ["--decoder-first-pipeline-num-layers", "1"],
               "accounted": ["--num-virtual-stages-per-pipeline-rank", "2", "--account-for-embedding-in-pipeline-split"],
               "moe-interleaved": ["--num-virtual-stages-per-pipeline-rank", "2", "--ep-size", "2"],
               "layout": ["--pipeline-model-parallel-layout", "Et|t|tt|L"], "layout-empty": ["--pipeline-model-parallel-layout", "Et*2||t*2|L"]}


def pipeline_run(scenario: str, ckpt, out, split: dict[str, str], layout: str | None = None) -> list[float]:
    os.makedirs(out, exist_ok=True)
    env = {**worker_env(), "MCORE_TP": "1", "MCORE_PP": "2", **split, **({"MCORE_DISTOPT_LAYOUT": layout} if layout else {})}
    nproc = 2 * int(split.get("MCORE_EP", "1"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER, scenario, str(ckpt), str(out)]
    run_workers(cmd, env, timeout=300)
    return json.loads((Path(out) / "losses.json").read_text())


def convert(src, dst, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(src), str(dst), *flags], capture_output=True,
                          text=True, env=worker_env(), cwd=ROOT)


# the worker's saves, each format's name -> (scenario, distributed-optimizer layout)
SAVES = {"legacy": ("save-legacy", None), "distrib_optim": ("save-legacy-distopt", None),
         "fully_reshardable": ("save-dist-distopt", "fully_reshardable"), "dp_reshardable": ("save-dist-distopt", "dp_reshardable")}
# writing each: convert flags and the worker's load
WRITES = {"legacy": (["--to", "megatron"], "load-legacy", None),
          "distrib_optim": (["--to", "megatron", "--use-distributed-optimizer"], "load-legacy-distopt", None),
          "fully_reshardable": (["--to", "megatron-dist", "--dist-optim-layout", "fully_reshardable"], "load-dist-distopt", "fully_reshardable"),
          "dp_reshardable": (["--to", "megatron-dist", "--dist-optim-layout", "dp_reshardable"], "load-dist-distopt", "dp_reshardable")}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """megatron-core's save of a split in a format, after one step, and its uninterrupted run's losses (once each
    per module: the tests only read them)."""
    runs: dict[tuple[str, str], tuple[Path, list[float]]] = {}

    def get(split: str, fmt: str) -> tuple[Path, list[float]]:
        if (split, fmt) not in runs:
            scenario, layout = SAVES[fmt]
            root = tmp_path_factory.mktemp(f"{split}-{fmt}")
            runs[(split, fmt)] = root / "ckpt", pipeline_run(scenario, root / "ckpt", root / "out", SPLITS[split], layout)
        return runs[(split, fmt)]

    return get


def _resume(tmp_path, src, split: str, fmt: str, *extra: str) -> list[float]:
    """src -> ours in ``fmt`` at TP1 x PP2 with the split's flags -> megatron-core loads it and trains on."""
    flags, scenario, layout = WRITES[fmt]
    dst = tmp_path / f"ours-{fmt}"
    done = convert(src, dst, *flags, "--tp", "1", "--pp", "2", "--transformer-impl", "local", *extra)
    assert done.returncode == 0, done.stderr
    return pipeline_run(scenario, dst, tmp_path / f"out-{fmt}", SPLITS[split], layout)


@megatron_core
@pytest.mark.dist
@pytest.mark.parametrize("split,src_fmt,dst_fmt", [
    # (interleaved distrib_optim.pt -> dp_reshardable: the layout-empty row below, two chunks per stage, and slow)
    pytest.param("interleaved", "distrib_optim", "dp_reshardable", marks=pytest.mark.slow),
    ("uneven", "dp_reshardable", "distrib_optim"),
    pytest.param("interleaved", "dp_reshardable", "distrib_optim", marks=pytest.mark.slow),
    pytest.param("interleaved", "legacy", "legacy", marks=pytest.mark.slow),
    pytest.param("interleaved", "fully_reshardable", "fully_reshardable", marks=pytest.mark.slow),
    pytest.param("uneven", "distrib_optim", "dp_reshardable", marks=pytest.mark.slow),
    pytest.param("accounted", "distrib_optim", "dp_reshardable", marks=pytest.mark.slow),
    pytest.param("accounted", "dp_reshardable", "legacy", marks=pytest.mark.slow),
    # a ChainedOptimizer's dense and expert buffers, each one per model chunk
    pytest.param("moe-interleaved", "dp_reshardable", "dp_reshardable", marks=pytest.mark.slow),
    pytest.param("moe-interleaved", "fully_reshardable", "dp_reshardable", marks=pytest.mark.slow),
    # legacy files per TP x PP x EP rank (mp_rank_TT_PPP_EEE: model0, model1; distrib_optim.pt the chained list)
    pytest.param("moe-interleaved", "distrib_optim", "distrib_optim", marks=pytest.mark.slow),
    pytest.param("moe-interleaved", "dp_reshardable", "distrib_optim", marks=pytest.mark.slow),
    # --pipeline-model-parallel-layout, a chunk holding no layer, and one holding nothing at all
    ("layout-empty", "distrib_optim", "dp_reshardable"),
    pytest.param("layout", "dp_reshardable", "legacy", marks=pytest.mark.slow),
    pytest.param("layout", "fully_reshardable", "distrib_optim", marks=pytest.mark.slow),
    pytest.param("layout-empty", "dp_reshardable", "fully_reshardable", marks=pytest.mark.slow),
    pytest.param("layout-empty", "legacy", "distrib_optim", marks=pytest.mark.slow),
])
def test_megatron_core_pipeline_split_resumes_exactly(tmp_path, saved, split, src_fmt, dst_fmt):
    """megatron-core saves with a virtual (interleaved) or uneven pipeline, its distributed optimizer a gradient
    buffer per model chunk -> universal -> ours for the same split -> megatron-core loads it and trains on with the
    uninterrupted run's losses. Before, both reads were refused ("2 gradient buffers", "3 layers do not split
    evenly") and no split but the even one could be written."""
    ckpt, uninterrupted = saved(split, src_fmt)
    done = convert(ckpt, tmp_path / "uni", "--to", "universal")
    assert done.returncode == 0, done.stderr
    resumed = _resume(tmp_path, tmp_path / "uni", split, dst_fmt, *SPLIT_FLAGS[split])
    assert resumed == pytest.approx(uninterrupted[1:], rel=1e-6, abs=1e-5)
    assert resumed[-1] != pytest.approx(uninterrupted[0], abs=1e-3)  # it trained on, from where it stopped


@megatron_core
@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("split", ["interleaved", "uneven", "layout-empty"])
def test_megatron_core_pipeline_split_every_format_reads_alike(tmp_path, saved, split):
    """One split, saved by megatron-core in each of its four layouts (the same training, the same losses): every
    read gives the same universal checkpoint, tensor for tensor."""
    unis = []
    for fmt in SAVES:
        ckpt, _ = saved(split, fmt)
        done = convert(ckpt, tmp_path / f"uni-{fmt}", "--to", "universal")
        assert done.returncode == 0, done.stderr
        unis.append(tmp_path / f"uni-{fmt}")
    for other in unis[1:]:
        diff = subprocess.run([sys.executable, "-m", "converters.cli", "diff", str(unis[0]), str(other)], capture_output=True,
                              text=True, env=worker_env(), cwd=ROOT)
        assert diff.returncode == 0 and " 0 different; 0 only in A, 0 only in B" in diff.stdout, diff.stdout + diff.stderr


@megatron_core
@pytest.mark.dist
def test_megatron_core_source_split_is_the_default_at_its_pipeline_size(tmp_path, saved):
    """An uneven megatron-core run converted back to Megatron at its own pipeline size keeps its split (said in a
    note): the output is the one written with the split's flags given, which megatron-core loads (the uneven row
    above); at another pipeline size the split is the user's to give, and an impossible one is refused in one line
    before anything is written."""
    ckpt, _ = saved("uneven", "dp_reshardable")
    target = ["--to", "megatron", "--use-distributed-optimizer", "--transformer-impl", "local"]
    done = convert(ckpt, tmp_path / "ours", *target)
    assert done.returncode == 0, done.stderr
    assert "note: pipeline split: the source's (--decoder-first-pipeline-num-layers 1)" in done.stdout + done.stderr
    assert convert(ckpt, tmp_path / "given", *target, *SPLIT_FLAGS["uneven"]).returncode == 0
    files = sorted(p.relative_to(tmp_path / "given") for p in (tmp_path / "given").rglob("*.pt"))
    assert len(files) == 4  # model_optim_rng.pt and distrib_optim.pt on each stage
    for f in files:
        assert (tmp_path / "ours" / f).read_bytes() == (tmp_path / "given" / f).read_bytes(), f
    bad = convert(ckpt, tmp_path / "bad", "--to", "megatron", "--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2")
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert bad.stderr.strip().splitlines()[-1] == (
        "interop convert: error: --pp 2: 3 layers do not split evenly over 2 pipeline stages x 2 virtual stages; give the "
        "loading run's split (--decoder-first-pipeline-num-layers, --decoder-last-pipeline-num-layers, ...)")


@megatron_core
@pytest.mark.dist
def test_megatron_core_layout_is_kept_and_checked(tmp_path, saved):
    """A --pipeline-model-parallel-layout run converted to Megatron at its pipeline size keeps its layout (said in
    a note, as a command line would quote it, and recorded in the args, which inspect reads back); a layout that does
    not fit the model is refused in one line before anything is written."""
    ckpt, _ = saved("layout-empty", "distrib_optim")
    done = convert(ckpt, tmp_path / "ours", "--to", "megatron-dist", "--dist-optim-layout", "dp_reshardable", "--transformer-impl", "local")
    assert done.returncode == 0, done.stderr
    assert "note: pipeline split: the source's (--pipeline-model-parallel-layout 'Et*2||t*2|L')" in done.stdout + done.stderr
    shown = subprocess.run([sys.executable, "-m", "converters.cli", "inspect", str(tmp_path / "ours")], capture_output=True, text=True,
                           env=worker_env(), cwd=ROOT)
    assert "pipeline={'pipeline_model_parallel_layout': 'Et*2||t*2|L'}" in shown.stdout, shown.stdout + shown.stderr
    for layout, says in (("Et|t|t|L", "holds 3 decoder layers (t), the model 4"), ("Ett|tt|L", "3 segments do not split over 2 pipeline stages"),
                         ("Ett|ttm|L|", "places multi-token prediction layers (m), which interop does not convert")):
        bad = convert(ckpt, tmp_path / "bad", "--to", "megatron", "--pp", "2", "--pipeline-model-parallel-layout", layout)
        assert bad.returncode == 2 and not (tmp_path / "bad").exists()
        assert bad.stderr.strip().splitlines()[-1].endswith(says), bad.stderr


@megatron_core
@pytest.mark.dist
def test_distributed_optimizer_param_groups_are_checked(tmp_path, saved):
    """A param group's step, weight decay or wd_mult that is not a number, beside a virtual pipeline's
    distrib_optim.pt, is one error naming the file and the key (it had failed deep inside the reader: "Could not
    infer dtype of NoneType")."""
    import shutil

    ckpt, _ = saved("layout-empty", "distrib_optim")
    for key, value in (("step", None), ("wd_mult", "x")):
        damaged = tmp_path / f"damaged-{key}"
        shutil.copytree(ckpt, damaged)
        rank = damaged / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt"
        # in a process of its own: unpickling Megatron-LM's args imports megatron-core (see test_megatron_core)
        edit = (f"import torch; s = torch.load({str(rank)!r}, weights_only=False); "
                f"s['optimizer']['optimizer']['param_groups'][0][{key!r}] = {value!r}; torch.save(s, {str(rank)!r})")
        subprocess.run([sys.executable, "-c", edit], check=True, capture_output=True, env=worker_env())
        done = convert(damaged, tmp_path / f"out-{key}", "--to", "universal")
        assert done.returncode == 2 and not (tmp_path / f"out-{key}").exists(), done.stderr
        last = done.stderr.strip().splitlines()[-1]
        assert str(rank) in last and f"optimizer.param_groups[0].{key}" in last, last
