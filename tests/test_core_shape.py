"""The decoding core's shape: EOS for every target kind, timing-free seeded randomness, one method
table, a client that does not import the server, and data folders that work from a wheel."""
import inspect
import subprocess
import sys
from pathlib import Path

import pytest

from specbench.api import outputs, run
from specbench.decode.target import LocalTarget
from specbench.models.loading import load_model
from specbench.models.spec import ModelSpec
from specbench.types import SamplingParams, default_rule

from conftest import PROMPTS
from worker_helpers import process_worker

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def eos_name():
    """A tiny model whose EOS is the 7th token it generates for PROMPTS[0] (it has none of its own)."""
    plain = outputs(run("tiny-random:seed=0", PROMPTS[:1], method="target-only", max_new_tokens=12,
                        progress=False, warmup=False))[("target-only", 0)]
    return f"tiny-random:seed=0,eos={plain[6]}", plain[: plain.index(plain[6]) + 1]


def test_eos_is_honoured_for_every_target_kind(eos_name):
    """Before, a LocalTarget instance passed to run() lost its EOS ids and generated past EOS."""
    from specbench.worker.client import RemoteTarget

    name, expected = eos_name
    loaded = load_model(ModelSpec(name))
    assert loaded.eos_token_ids == (expected[-1],)
    targets = {"name": name, "ModelSpec": ModelSpec(name), "LoadedModel": loaded, "LocalTarget": LocalTarget(loaded)}
    with process_worker("--model", name) as worker:
        targets["RemoteTarget"] = RemoteTarget(worker.endpoint)
        for kind, target in targets.items():
            got = outputs(run(target, PROMPTS[:1], method=["target-only", "prompt-lookup"], max_new_tokens=12,
                              progress=False, warmup=False))
            assert got[("target-only", 0)] == expected, kind
            assert got[("prompt-lookup", 0)] == expected, kind


def test_seeded_proactive_sampling_does_not_depend_on_reply_time(tiny_target):
    """Draft draws are keyed by position and verify seeds have their own stream, so a delay that
    changes how much is drafted ahead changes no token. The draft is the target itself at a low
    temperature, so whole chains are accepted and look-aheads are often reused."""
    from specbench.worker.client import NetworkEmulation, RemoteTarget

    tiny_draft = tiny_target
    sampling = SamplingParams(temperature=0.5, rule="rejection")
    with process_worker() as worker:
        runs = {}
        for rtt in (0.0, 40.0):
            remote = RemoteTarget(worker.endpoint, network=NetworkEmulation(rtt_ms=rtt))
            runs[rtt] = run(remote, PROMPTS, method="chain", draft=tiny_draft, k=3, max_new_tokens=24,
                            sampling=sampling, seed=11, proactive=True, progress=False, warmup=False)
    delayed = runs[40.0]
    assert delayed["lookahead_drafted"].sum() > 0 and delayed["lookahead_reused"].sum() > 0, "nothing was drafted ahead"
    assert outputs(runs[0.0]) == outputs(delayed)
    local = run("tiny-random:seed=0", PROMPTS, method="chain", draft=tiny_draft, k=3, max_new_tokens=24,
                sampling=sampling, seed=11, progress=False, warmup=False)
    assert outputs(local) == outputs(delayed)  # and proactive or not, local or remote


def test_a_method_registered_in_one_file_runs_through_run_and_the_cli(tiny_target, smollm2, capsys):
    import custom_method  # noqa: F401  (registers "repeat-last" on import)

    from specbench.cli import main

    records = run(tiny_target, PROMPTS, method=["target-only", "repeat-last"], max_new_tokens=16, progress=False)
    got = outputs(records)
    for index in range(len(PROMPTS)):
        assert got[("repeat-last", index)] == got[("target-only", index)]
    assert set(records[records.method == "repeat-last"]["kind"]) == {"chain"}
    assert main(["run", "--target", "smollm2-135m", "--method", "target-only", "repeat-last",
                 "--prompt", "Say hello twice: hello hello", "--max-new-tokens", "8"]) == 0
    table = capsys.readouterr().out
    assert "repeat-last" in table and "target-only" in table


def test_client_does_not_import_the_server():
    code = ("import sys, specbench.worker.client; "
            "assert 'specbench.worker.server' not in sys.modules and 'specbench.worker.ops' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def import_graph() -> dict[str, set[str]]:
    """specbench module -> the specbench modules it imports anywhere in its text (lazy imports included)."""
    import ast

    graph = {}
    for path in (ROOT / "specbench").rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        imported = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("specbench"):
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names if alias.name.startswith("specbench")}
        graph[name] = imported
    return graph


def test_no_import_circle():
    """models/loading.py and models/tiny.py imported each other; no two modules may now."""
    graph = import_graph()
    for start in graph:
        seen, stack = set(), [(start, (start,))]
        while stack:
            module, path = stack.pop()
            for nxt in graph.get(module, ()):
                assert nxt != start, f"import circle: {' -> '.join(path + (nxt,))}"
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, path + (nxt,)))


def test_loop_and_step_fit_one_screen_and_modules_stay_small():
    from specbench.decode.loop import generate
    from specbench.decode.step import speculative_step

    for function in (generate, speculative_step):
        lines = inspect.getsource(function).splitlines()
        body = [line for line in lines[1:] if line.strip()]
        assert len(body) <= 40, f"{function.__name__} has {len(body)} lines"
    for path in (ROOT / "specbench").rglob("*.py"):
        assert len(path.read_text().splitlines()) <= 420, f"{path.relative_to(ROOT)} is over ~400 lines"


def test_the_set_ups_bytecode_list_names_modules_that_exist():
    """`make setup` writes bytecode only for what .ci/bytecode.py imports: a name a dependency renamed would be
    skipped there without failing the set-up, and its modules compiled again at every start where
    PYTHONDONTWRITEBYTECODE is set."""
    import importlib.util
    import runpy

    groups = runpy.run_path(str(ROOT / ".ci" / "bytecode.py"))["GROUPS"]
    assert set(groups) == {"package", "tools"}
    missing = [name for names in groups.values() for name in names if importlib.util.find_spec(name) is None]
    assert not missing, missing


def test_cli_defaults_equal_the_library_defaults():
    from specbench.cli import build_parser
    from specbench.worker.server import WorkerConfig

    run_args = build_parser().parse_args(["run"])
    assert run_args.temperature == SamplingParams().temperature
    assert default_rule(run_args.temperature) == SamplingParams().rule and run_args.rule is None
    assert run_args.seed == inspect.signature(run).parameters["seed"].default
    worker_args = build_parser().parse_args(["worker"])
    assert worker_args.lazy == WorkerConfig().lazy


def test_data_folders_are_found_from_a_wheel_install(tmp_path):
    """profiles/, reference/ and datasets/ ship as data files and are found without the checkout."""
    wheels, prefix = tmp_path / "wheels", tmp_path / "env"
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(wheels)], check=True, cwd=tmp_path)
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(prefix)], check=True)
    # The new environment's own pip: this environment's pip with --prefix would uninstall our editable install.
    subprocess.run([str(prefix / "bin" / "python"), "-m", "pip", "install", "--no-deps", "--no-index", "-q",
                    str(next(wheels.glob("*.whl")))], check=True)
    code = ("from specbench.plan.library import load_profiles, load_references, PROFILES; "  # stdlib only: no deps
            "from specbench.data_paths import data_folder; "
            "print(PROFILES, len(load_profiles()), len(load_references()), "
            "(data_folder('datasets') / 'bench_prompts.jsonl').exists())")
    shown = subprocess.run([str(prefix / "bin" / "python"), "-c", code], check=True, cwd=tmp_path,
                           capture_output=True, text=True).stdout.split()
    shipped_profiles = len([p for p in (ROOT / "profiles").glob("profile-*.json")])
    assert shown[0].startswith(str(prefix)) and "site-packages" not in shown[0], shown
    assert int(shown[1]) == shipped_profiles and int(shown[2]) > 0 and shown[3] == "True", shown


def test_a_cost_objective_registered_in_one_file_reaches_the_predictor_explorer_and_cli(tmp_path, capsys):
    """Adding an objective touched four files (the cost model, the explorer, the predictor's columns, the
    CLI's choices); now one `register` call, and every reader sees it."""
    import custom_objective  # noqa: F401  (registers "carbon" on import)

    from specbench.cli import build_parser, main
    from specbench.plan.explore import operating_points, prediction_frame, recommend
    from specbench.plan.library import save_profile, save_reference
    from specbench.viz.explorer import ParetoExplorer
    from test_viz import DRAFT, REFERENCE, TARGET

    frame = prediction_frame(TARGET, DRAFT, REFERENCE, operating_points(REFERENCE), cost="carbon")
    assert (frame["carbon_g_per_mtok"] > 0).all()
    assert recommend(frame, 1.0, "carbon")["carbon_g_per_mtok"] == frame["carbon_g_per_mtok"].min()
    explorer = ParetoExplorer({"view": [(TARGET, DRAFT, REFERENCE)]}, objective="carbon")
    assert "carbon" in explorer.controls["objective"].options and explorer.update() is not None
    pareto = next(action for action in build_parser()._subparsers._group_actions[0].choices["pareto"]._actions
                  if action.dest == "cost")
    assert "carbon" in pareto.choices
    save_profile(TARGET, folder=tmp_path / "p")
    save_profile(DRAFT, folder=tmp_path / "p")
    save_reference(REFERENCE, folder=tmp_path / "r")
    out = tmp_path / "carbon.html"
    assert main(["pareto", "--profiles", str(tmp_path / "p"), "--references", str(tmp_path / "r"), "--cost", "carbon",
                 "--out", str(out)]) == 0
    assert "carbon (g per 1M tokens" in out.read_text()


def test_a_run_interleaves_its_methods_and_each_gives_what_it_gives_alone(tiny_target, tiny_draft):
    """Every method runs a prompt before the next prompt starts, the order rotated per prompt (so drift weighs on
    all alike); each method's outputs and steps are the ones it makes run on its own (seeded sampling)."""
    methods = ["target-only", "chain", "prompt-lookup"]
    sampling = SamplingParams(temperature=1.0, rule="rejection")
    records = run(tiny_target, PROMPTS[:4], method=methods, draft=tiny_draft, k=3, max_new_tokens=6,
                  sampling=sampling, seed=3, progress=False)
    order = list(dict.fromkeys(zip(records["method"], records["prompt_index"])))
    assert order == [(methods[(index + i) % 3], index) for index in range(4) for i in range(3)]
    for method in methods:
        alone = run(tiny_target, PROMPTS[:4], method=method, draft=tiny_draft, k=3, max_new_tokens=6,
                    sampling=sampling, seed=3, progress=False)
        mine = records[records["method"] == method]
        assert outputs(alone) == outputs(mine)
        assert alone["accepted"].tolist() == mine["accepted"].tolist()
