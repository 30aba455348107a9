"""The `flywheel` command line: models, serving and the artifact store.

Every failure ends as one `error: ...` line on stderr, never a traceback: exit code 2 for a bad
command line (unknown command or option, missing or malformed value), 1 for the rest (unknown ref,
bad URL, missing credentials, unreachable endpoint, invalid config). `--store` works before or
after the subcommand; `--json` gives scripts the data instead of tables; piped output never wraps.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table
from rich.text import Text
from rich.tree import Tree

from flywheel.data import ArtifactStore, LineageNode, Manifest, StoreError, lineage
from flywheel.data.columnar import export_jsonl
from flywheel.flows.cli_errors import click_error_line, failure_line
from flywheel.flows.console import printable, stderr_handler
from flywheel.flows.fast_malloc import reexec_with_fast_malloc
from flywheel.inference import ModelServer, ServerConfig, ServerError, build_command, chat
from flywheel.training import BUILTIN_MODELS, ModelError, prepare_model, resolve_model
from flywheel.training.config import ConfigError
from flywheel.training.launch import Machines, launch_command
from flywheel.training.models import default_cache_dir
from flywheel.training.registry import ALGORITHMS, load_run_config, run_training

if TYPE_CHECKING:
    from flywheel.flows.round_config import RoundConfig

app = typer.Typer(help="A data flywheel for tool-using LLM agents.")
model_app = typer.Typer(help="Prepare built-in models.")
artifacts_app = typer.Typer(help="Inspect the artifact store.")
app.add_typer(model_app, name="model")
train_app = typer.Typer(help="Train: SFT, RL (GRPO) and DPO from a YAML config plus key=value overrides.")
app.add_typer(artifacts_app, name="artifacts")
app.add_typer(train_app, name="train")
infra_app = typer.Typer(help="Prefect work pools, the GPU concurrency limit, crash detection and failure alerts.")
app.add_typer(infra_app, name="infra")


def _stdout_console() -> Console:
    """Rich on a terminal; piped, lines never wrap (scripts read the paths and ids printed)."""
    terminal = Console()
    return terminal if terminal.is_terminal else Console(soft_wrap=True, width=1_000_000)


console = _stdout_console()
err_console = Console(stderr=True)
USER_ERRORS = (StoreError, ServerError, ModelError, ConfigError)
STORE_HELP = "Store URL: a path, file://PATH or s3://BUCKET/PREFIX."
StoreOption = Annotated[str | None, typer.Option("--store", help=STORE_HELP, show_default=False)]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON instead of text.")]


class _State:
    store_url: str | None = None
    verbose: bool = False

    @property
    def store(self) -> ArtifactStore:
        return ArtifactStore(self.store_url)


state = _State()


@app.callback()
def _root(
    store: Annotated[str | None, typer.Option("--store", envvar="FLYWHEEL_STORE", help=STORE_HELP)] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Every library's logs on stderr.")] = False,
) -> None:
    state.store_url, state.verbose = store, verbose
    # Warnings and errors on stderr; `-v`: every library's logs (the model server's output among them).
    handler = stderr_handler()
    handler.setLevel(logging.DEBUG if verbose else logging.WARNING)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING, handlers=[handler])
    for noisy in ("httpx", "botocore", "aiobotocore", "s3fs"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def _byte_progress(description: str, total: int | None = None) -> Iterator[Callable[[int], None]]:
    """A rich progress bar fed with byte counts (hashing and copying report as they go)."""
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
    with Progress(*columns, console=err_console, transient=True) as progress:
        task = progress.add_task(_markup(description), total=total)
        yield lambda n: progress.advance(task, n)


def _markup(value: object) -> str:
    """A user's or the store's text made safe inside Rich markup: control characters and tags escaped."""
    return escape(printable(value))


def _write(text: str) -> None:
    """`text` on the command's own output (stdout, where libraries never write: see `main`), control characters
    escaped."""
    console.file.write("\n".join(printable(line) for line in text.split("\n")) + "\n")
    console.file.flush()


def _print_json(data: Any) -> None:
    """`data` as indented JSON on stdout, without Rich's markup or highlighting."""
    _write(json.dumps(data, indent=2))


def _manifest_json(manifest: Manifest) -> dict[str, Any]:
    return {"id": manifest.id, **manifest.model_dump(mode="json")}


# -- models ------------------------------------------------------------------------------------


@model_app.command("prepare")
def model_prepare(
    name: Annotated[str, typer.Argument(help=f"Built-in model: {' | '.join(BUILTIN_MODELS)}.")],
    force: Annotated[bool, typer.Option(help="Rebuild even if the store has it.")] = False,
    as_json: JsonOption = False,
) -> None:
    """Build a built-in model once and keep it in the store as `model/NAME`."""
    store = state.store
    with _byte_progress(f"storing model/{name}") as progress:
        manifest = prepare_model(name, store, force=force, progress=progress)
    path = resolve_model(name, store)
    if as_json:
        _print_json({"ref": f"model/{name}", "id": manifest.id, "size": manifest.size, "path": str(path)})
        return
    console.print(f"model/{_markup(name)} = {manifest.id[:12]} ({manifest.size / 1e6:.0f} MB) at {_markup(path)}")


# -- serving -----------------------------------------------------------------------------------


def _server_config(model: str, backend: str, host: str, port: int, tensor_parallel_size: int) -> ServerConfig:
    return ServerConfig.checked(
        model=str(resolve_model(model, state.store)),
        served_model_name=model if model in BUILTIN_MODELS else None,
        backend=backend,
        host=host,
        port=port,
        tensor_parallel_size=tensor_parallel_size,
    )


BackendOption = Annotated[str, typer.Option(help="transformers (CPU) or vllm (GPU).")]


@app.command()
def serve(
    model: Annotated[str, typer.Argument(help="smollm2 | tiny | store ref | local dir | cached HF id.")],
    backend: BackendOption = "transformers",
    host: Annotated[str, typer.Option(help="Listen address.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="Listen port (0: any free port).")] = 8000,
    tensor_parallel_size: Annotated[int, typer.Option(help="vLLM: GPUs per replica.")] = 1,
    dry_run: Annotated[bool, typer.Option(help="Print the server command and exit.")] = False,
) -> None:
    """Serve a model behind an OpenAI-compatible API until interrupted."""
    config = _server_config(model, backend, host, port, tensor_parallel_size)
    if dry_run:
        console.print(_markup(" ".join(build_command(config, config.port))), soft_wrap=True, highlight=False)
        return
    with ModelServer(config) as server:
        name, url = _markup(server.model_name), _markup(server.base_url)
        console.print(f"serving [bold]{name}[/] at [bold]{url}[/] (Ctrl-C stops)")
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
        with contextlib.suppress(KeyboardInterrupt):
            assert server.process is not None
            server.process.wait()


@app.command("chat")
def chat_once(
    model: Annotated[str, typer.Argument(help="smollm2 | tiny | store ref | local dir | cached HF id.")],
    prompt: Annotated[str, typer.Argument(help="The user message.")],
    system: Annotated[str, typer.Option(help="System message.")] = "You are a helpful assistant.",
    max_tokens: Annotated[int, typer.Option(help="Reply length cap.")] = 64,
    backend: BackendOption = "transformers",
) -> None:
    """Start a server for MODEL, send one chat round-trip (greedy), print the reply, stop."""
    config = _server_config(model, backend, "127.0.0.1", 0, 1)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    with ModelServer(config) as server:
        assert server.model_name is not None
        reply = chat(server.base_url, server.model_name, messages, temperature=0.0, max_tokens=max_tokens)
    console.print(f"[bold]user:[/] {_markup(prompt)}\n[bold]assistant:[/] {_markup(reply)}")


# -- artifacts ---------------------------------------------------------------------------------


@artifacts_app.command("ls")
def artifacts_ls(
    kind: Annotated[str | None, typer.Argument(help="Only this kind.")] = None, as_json: JsonOption = False
) -> None:
    """List artifacts, oldest first, with the refs that point at them."""
    store = state.store
    by_target: dict[str, list[str]] = {}
    for name, target in store.refs().items():
        by_target.setdefault(target, []).append(name)
    manifests = store.list(kind)
    if as_json:
        _print_json([{**_manifest_json(m), "refs": sorted(by_target.get(m.id, []))} for m in manifests])
        return
    table = Table("id", "kind", "name", "files", "size", "created", "refs")
    for manifest in manifests:
        table.add_row(
            manifest.id[:12],
            _markup(manifest.kind),
            _markup(manifest.name),
            str(len(manifest.files)),
            f"{manifest.size / 1e6:.1f} MB",
            _markup(manifest.created),
            _markup(", ".join(sorted(by_target.get(manifest.id, [])))),
        )
    console.print(table)


@artifacts_app.command("show")
def artifacts_show(
    ref: Annotated[str, typer.Argument(help="Ref, kind/name, id or id prefix.")], as_json: JsonOption = False
) -> None:
    """Print an artifact's manifest as JSON (highlighted on a terminal; plain with --json)."""
    manifest = _manifest_json(state.store.manifest(ref))
    if as_json:
        _print_json(manifest)
        return
    console.print_json(json.dumps(manifest))


@artifacts_app.command("lineage")
def artifacts_lineage(ref: Annotated[str, typer.Argument(help="Ref, kind/name, id or id prefix.")]) -> None:
    """Print the tree of artifacts REF was made from."""
    root = lineage(state.store, ref)
    tree = Tree(f"[bold]{_markup(f'{root.manifest.kind}/{root.manifest.name}')}[/] [dim]{root.manifest.id[:12]}[/]")
    stack: list[tuple[Tree, LineageNode]] = [(tree, parent) for parent in reversed(root.parents)]
    while stack:  # Not recursive: a long chain of rounds must not reach Python's recursion limit.
        branch, node = stack.pop()
        m = node.manifest
        label = f"{_markup(f'{m.kind}/{m.name}')} [dim]{m.id[:12]} {_markup(m.created)}[/]"
        twig = branch.add(label + (" (above)" if node.repeated else ""))
        stack += [(twig, parent) for parent in reversed(node.parents)]
    console.print(tree)


@artifacts_app.command("get")
def artifacts_get(
    ref: Annotated[str, typer.Argument(help="Ref, kind/name, id or id prefix.")],
    dest: Annotated[Path, typer.Argument(file_okay=False, help="Directory to write the files into.")],
) -> None:
    """Copy an artifact's files to DEST, verifying every blob."""
    store = state.store
    manifest = store.manifest(ref)
    with _byte_progress(f"get {manifest.kind}/{manifest.name}", total=manifest.size) as progress:
        store.get(manifest.id, dest, progress=progress)
    console.print(f"{len(manifest.files)} files ({manifest.size / 1e6:.1f} MB) -> {_markup(dest)}")


@artifacts_app.command("export")
def artifacts_export(
    ref: Annotated[str, typer.Argument(help="A dataset or rollouts artifact: ref, kind/name, id or id prefix.")],
    out: Annotated[Path, typer.Argument(dir_okay=False, help="The JSONL file to write.")],
    split: Annotated[str | None, typer.Option(help="Only this split (default: every one, in order).")] = None,
) -> None:
    """Write an artifact's rows (stored as Parquet shards) as JSONL, one row a line."""
    written = export_jsonl(state.store, ref, out, split)
    console.print(f"{written} rows -> {_markup(out)}")


@artifacts_app.command("verify")
def artifacts_verify(
    clean_staging: Annotated[
        bool, typer.Option(help="Delete leftovers of killed writes instead of reporting them.")
    ] = False,
) -> None:
    """Check every manifest, blob and ref, and staging leftovers; exit 1 if anything is wrong."""
    problems = state.store.verify(clean_staging=clean_staging)
    for problem in problems:
        err_console.print(f"[red]problem:[/] {_markup(problem)}", soft_wrap=True)
    if problems:
        raise typer.Exit(1)
    console.print("store OK")


# -- training ----------------------------------------------------------------------------------

ConfigOption = Annotated[Path, typer.Option("--config", help="YAML config (see training/configs/).")]
Overrides = Annotated[list[str] | None, typer.Argument(help="key=value overrides of config fields.")]


GpusOption = Annotated[
    int, typer.Option(min=1, help="Launch on this many GPUs with accelerate (ZeRO / FSDP per config).")
]
DryRunOption = Annotated[bool, typer.Option(help="Print the multi-GPU launch command and exit.")]
NodesOption = Annotated[int, typer.Option(min=1, help="Machines the run spans, `--gpus` each; run this on every one.")]
NodeRankOption = Annotated[int, typer.Option(help="This machine's number, 0 to nodes-1 (0 hosts the rendezvous).")]
MainAddressOption = Annotated[str, typer.Option(help="Machine 0's address, as every machine reaches it.")]
MainPortOption = Annotated[int, typer.Option(help="The rendezvous port on machine 0.")]


def _train_command(algorithm: str | None) -> Callable[..., None]:
    """The `flywheel train` command of `algorithm` (None: the one the config names, GRPO by default)."""

    def command(
        config: ConfigOption,
        overrides: Overrides = None,
        gpus: GpusOption = 1,
        nodes: NodesOption = 1,
        node_rank: NodeRankOption = 0,
        main_address: MainAddressOption = "127.0.0.1",
        main_port: MainPortOption = 29500,
        dry_run: DryRunOption = False,
    ) -> None:
        if not 0 <= node_rank < nodes:
            raise ConfigError(f"--node-rank {node_rank} is not one of the {nodes} machines (0 to {nodes - 1})")
        _train(algorithm, config, overrides, gpus, dry_run, Machines(nodes, node_rank, main_address, main_port))

    return command


def add_train_commands(group: typer.Typer) -> None:
    """One `train` command per registered algorithm (`training/registry.py`), and `rl`: the config's own."""
    for name, registered in ALGORITHMS.items():
        group.command(name, help=registered.summary)(_train_command(name))
    group.command("rl", help="Online RL or preference training: the algorithm the config names (default grpo).")(
        _train_command(None)
    )


add_train_commands(train_app)


def _train(
    algorithm: str | None, config: Path, overrides: list[str] | None, gpus: int, dry_run: bool, machines: Machines
) -> None:
    """Load the config its algorithm names (flywheel.training.registry); run it here, or launched on `gpus` GPUs
    of each of `machines`."""
    cfg = load_run_config(config, overrides, default=algorithm or "grpo")
    if algorithm and cfg.algorithm != algorithm:
        raise ConfigError(f"{config} is a {cfg.algorithm} config: run `flywheel train {cfg.algorithm}` with it")
    if gpus > 1 or machines.count > 1 or dry_run:
        command = launch_command(cfg, str(config), gpus, overrides or [], state.store_url, machines)
        if dry_run:
            console.print(_markup(" ".join(command)), soft_wrap=True, highlight=False)
            return
        raise typer.Exit(subprocess.call(command))
    try:
        manifest = run_training(cfg, state.store)
    except ValueError as err:
        raise ConfigError(str(err)) from err
    console.print(f"checkpoint/{_markup(manifest.name)} = {manifest.id[:12]}  {_markup(json.dumps(manifest.metrics))}")


# -- evaluation --------------------------------------------------------------------------------


@app.command("eval")
def evaluate(
    model: Annotated[str, typer.Option("--model", help="smollm2 | tiny | store ref | local dir.")],
    tasks: Annotated[list[str] | None, typer.Option("--tasks", help="lm-eval task names (default: the suite).")] = None,
    include_path: Annotated[Path | None, typer.Option("--include-path", help="Folder of user task YAML.")] = None,
    server: Annotated[str | None, typer.Option("--server", help="OpenAI-compatible URL of a served model.")] = None,
    backend: Annotated[str | None, typer.Option(help="hf | vllm | local-completions | local-chat-completions.")] = None,
    limit: Annotated[int | None, typer.Option(help="Docs per task.")] = None,
    batch_size: Annotated[int, typer.Option(help="Fixed batch size.")] = 32,
    suite: Annotated[str, typer.Option(help="flywheel (lm-eval suite) | agentic (the envs) | all.")] = "flywheel",
    eval_size: Annotated[int, typer.Option(help="agentic: held-out tasks per env.")] = 8,
    max_infra_failure_rate: Annotated[
        float, typer.Option(help="agentic: fail when an env's infra-failure share passes this.", min=0.0, max=1.0)
    ] = 0.05,
    as_json: JsonOption = False,
) -> None:
    """Evaluate a model: lm-evaluation-harness (shipped suite, user or bundled tasks) and/or the envs.

    `--json` prints `{"agentic": {ref, id, metrics}, "lm_eval": {ref, id, results}}` (the suites that ran).
    """
    if suite not in ("flywheel", "agentic", "all"):
        raise ConfigError(f"unknown suite '{suite}': choose flywheel, agentic or all")
    store = state.store
    model_dir = resolve_model(model, store)
    outcome: dict[str, Any] = {}
    if suite in ("agentic", "all"):
        agentic = _agentic_eval(model, model_dir, server, eval_size, max_infra_failure_rate)
        outcome["agentic"] = {"ref": f"eval/{agentic.name}", "id": agentic.id, "metrics": agentic.metrics}
        if not as_json:
            console.print(f"eval/{_markup(agentic.name)} = {agentic.id[:12]}  {_markup(json.dumps(agentic.metrics))}")
    if suite in ("flywheel", "all"):
        manifest = _lm_eval(model, model_dir, tasks, include_path, server, backend, limit, batch_size)
        results = store.read_json(manifest.id, "results.json")["results"]
        outcome["lm_eval"] = {"ref": f"eval/{manifest.name}", "id": manifest.id, "results": results}
        if not as_json:
            table = Table("task", "metric", "value")
            for task, values in results.items():
                for key, value in values.items():
                    if isinstance(value, float) and "stderr" not in key:
                        table.add_row(_markup(task), _markup(key.split(",")[0]), f"{value:.3f}")
            console.print(table)
            console.print(f"eval/{_markup(manifest.name)} = {manifest.id[:12]}")
    if as_json:
        _print_json(outcome)


def _lm_eval(
    model: str,
    model_dir: Path,
    tasks: list[str] | None,
    include_path: Path | None,
    server: str | None,
    backend: str | None,
    limit: int | None,
    batch_size: int,
) -> Manifest:
    from flywheel.evaluation.lm_eval_runner import LMEvalConfig, model_ref_of, run_lm_eval
    from flywheel.evaluation.suite import SUITE_TASKS

    store = state.store
    server_model = None
    if server:
        from flywheel.inference import wait_until_healthy

        server_model = wait_until_healthy(server.rstrip("/"), 30)
    try:
        cfg = LMEvalConfig(
            backend=backend or ("local-chat-completions" if server else "hf"),
            tasks=tasks or list(SUITE_TASKS),
            include_path=str(include_path.resolve()) if include_path else None,
            server_url=server,
            server_model=server_model,
            limit=limit,
            batch_size=batch_size,
        )
        return run_lm_eval(cfg, store, model_dir, model_ref_of(store, model))
    except ValueError as err:
        raise ConfigError(str(err)) from err


def _agentic_eval(
    model: str, model_dir: Path, server: str | None, eval_size: int, max_infra_failure_rate: float
) -> Manifest:
    from flywheel.evaluation.agentic import AgenticEvalConfig, run_agentic_eval
    from flywheel.evaluation.lm_eval_runner import model_ref_of
    from flywheel.inference import wait_until_healthy

    store = state.store
    with contextlib.ExitStack() as stack:
        if server is None:
            started = stack.enter_context(ModelServer(_server_config(model, "transformers", "127.0.0.1", 0, 1)))
            server, name = started.base_url, started.model_name
        else:
            name = wait_until_healthy(server.rstrip("/"), 30)
        cfg = AgenticEvalConfig(base_url=server, model_name=name, tokenizer=str(model_dir), eval_size=eval_size,
                                max_infra_failure_rate=max_infra_failure_rate)  # fmt: skip
        return run_agentic_eval(cfg, store, model_ref_of(store, model))


@app.command("report")
def report(
    refs: Annotated[list[str], typer.Argument(help="Eval, weaknesses, gate or rollouts refs; or a round number.")],
    name: Annotated[str | None, typer.Option(help="Report name.")] = None,
) -> None:
    """Build a round's HTML report (plots, summary, samples) and print where it is."""
    from flywheel.evaluation.report import build_report

    store = state.store
    rounds = None
    if len(refs) == 1 and refs[0].isdigit():
        from flywheel.flows.flywheel import round_refs
        from flywheel.flows.work import round_history

        rounds = round_history(store, int(refs[0]))
        refs = round_refs(store, int(refs[0]))
    manifest = build_report(store, refs, name or "report", rounds)
    out = store.materialize(manifest.id, default_cache_dir() / "reports")
    console.print(f"report/{_markup(manifest.name)} = {manifest.id[:12]}: {_markup(out / 'report.html')}")


# -- the flywheel --------------------------------------------------------------------------------


ProfileOption = Annotated[
    str | None,
    typer.Option(help="Shipped round config (flows/profiles/): default | quick | tiny | h100 [default: default].",
                 show_default=False),
]  # fmt: skip
RoundConfigOption = Annotated[
    Path | None, typer.Option("--config", help="Round YAML, layered over --profile when one is named.")
]
DeviceOption = Annotated[str | None, typer.Option(help="cpu | cuda | auto: where GPU stages run (device=...).")]


def _round_config(
    profile: str | None, config: Path | None, overrides: list[str] | None, device: str | None
) -> RoundConfig:
    """The round config the options and `key=value` overrides describe (`--device X` is `device=X`)."""
    from flywheel.flows.round_config import load_round_config

    return load_round_config(profile, config, [*(overrides or []), *([f"device={device}"] if device else [])])


@app.command("plan")
def plan(
    overrides: Overrides = None, profile: ProfileOption = None, config: RoundConfigOption = None,
    device: DeviceOption = None,
) -> None:  # fmt: skip
    """Print, as JSON, what each stage of a round would run (device, dtype, server, trainer, GPUs, pool)."""
    from flywheel.flows.plan import round_plan

    name = profile or (config.stem if config else "default")
    _print_json(round_plan(_round_config(profile, config, overrides, device), name))


@app.command("round")
def run_round(
    overrides: Overrides = None,
    profile: ProfileOption = None,
    config: RoundConfigOption = None,
    device: DeviceOption = None,
    rounds: Annotated[int, typer.Option(help="Rounds to run.")] = 1,
    quick: Annotated[bool, typer.Option(help="Profile `quick`: the tiny model, minutes instead of SmolLM2.")] = False,
    dispatch: Annotated[str, typer.Option(help="local (in-process) | deployments (each stage on its pool).")] = "local",
    first_round: Annotated[
        int | None, typer.Option(help="Start here (default: after the last finished round).")
    ] = None,
    show_config: Annotated[bool, typer.Option(help="Print the resolved round config as YAML and exit.")] = False,
) -> None:
    """Run flywheel rounds (Prefect flow `flywheel`); a re-run skips the stages that already finished.

    The round is `--profile` (default: `default`), then `--config FILE`, then `key=value` overrides
    (`sft.total_steps=8`); `--show-config` prints every field with its description."""
    from flywheel.flows.console import log_file_for, quiet_libraries, round_console
    from flywheel.flows.round_config import config_yaml

    if not state.verbose:
        quiet_libraries()
    if dispatch not in ("local", "deployments"):
        raise ConfigError(f"unknown dispatch '{dispatch}': choose local or deployments")
    profile = "quick" if quick else profile
    cfg = _round_config(profile, config, overrides, device)
    if show_config:
        _write(config_yaml(cfg))
        return
    cfg.check_one_machine()
    from flywheel.flows.flywheel import flywheel  # Prefect configures logging on import: routed after it.
    from flywheel.flows.results import results_table

    log_file = log_file_for(default_cache_dir())
    console.print(f"log: {_markup(log_file)}", highlight=False, soft_wrap=True)
    with round_console(console, log_file, state.verbose):
        report_id = flywheel(
            rounds=rounds, profile=profile or (config.stem if config else "default"), store_url=state.store_url,
            dispatch=dispatch, first_round=first_round, config=cfg,
        )  # fmt: skip
    store = state.store
    out = store.materialize(report_id, default_cache_dir() / "reports")
    _write(results_table(store))
    console.print(f"report: {_markup(out / 'report.html')}", highlight=False, soft_wrap=True)


@infra_app.command("setup")
def infra_setup(
    kubernetes: Annotated[bool, typer.Option(help="Pool h100 as Kubernetes (deploy/h100-job-template.json).")] = False,
    gpu_slots: Annotated[int, typer.Option(help="Size of the `gpu` global concurrency limit.")] = 8,
    alert_url: Annotated[str | None, typer.Option(help="Webhook to POST to when a flywheel run fails.")] = None,
) -> None:
    """Create or update the pools `cpu` and `h100`, the `gpu` limit, crash detection and the failure alert."""
    import httpx
    from prefect.settings import PREFECT_API_URL

    from flywheel.flows.infra import setup

    try:
        lines = setup(kubernetes, gpu_slots, alert_url)
    except httpx.TransportError as err:
        raise ConfigError(
            f"cannot reach the Prefect API at {PREFECT_API_URL.value()} ({err}): start `prefect server start` "
            "or set PREFECT_API_URL"
        ) from err
    for line in lines:
        console.print(_markup(line))


# -- every subcommand takes --store; every failure is one line -----------------------------------


@contextlib.contextmanager
def _own_stdout() -> Iterator[None]:
    """Stdout is the command's own output (tables, JSON, paths): while it runs, a library that prints
    or logs to sys.stdout (DeepSpeed's logger does, on import) writes to stderr instead."""
    console.file = sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        console.file = None  # type: ignore[assignment]  # Rich: back to whatever sys.stdout is.


def _with_store_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with a `--store` option of its own (Typer reads the added parameter from the signature),
    run with stdout kept for its own output."""

    @functools.wraps(command)
    def run(*args: Any, store: str | None = None, **kwargs: Any) -> Any:
        if store is not None:
            state.store_url = store
        with _own_stdout():
            return command(*args, **kwargs)

    signature = inspect.signature(command, eval_str=True)
    option = inspect.Parameter("store", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=StoreOption)
    run.__signature__ = signature.replace(parameters=[*signature.parameters.values(), option])  # type: ignore[attr-defined]
    return run


def _accept_store_everywhere(typer_app: typer.Typer) -> None:
    """Let `--store` follow any subcommand, not only precede it (`flywheel artifacts ls --store URL`)."""
    for command in typer_app.registered_commands:
        assert command.callback is not None
        command.callback = _with_store_option(command.callback)
    for group in typer_app.registered_groups:
        assert group.typer_instance is not None
        _accept_store_everywhere(group.typer_instance)


_accept_store_everywhere(app)


def _fail(message: str, code: int) -> None:
    err_console.print(Text.assemble(("error:", "red"), " ", printable(message)), highlight=False, soft_wrap=True)
    sys.exit(code)


def main(argv: Sequence[str] | None = None) -> None:
    """Entry point: run the app; a bad command line ends as one line and exit 2, any other failure exit 1.
    The console command first re-executes itself under tcmalloc where it is installed (`flywheel.flows.fast_malloc`)."""
    if argv is None:  # -P: a folder of the user's (`data/`, `flows/`) never shadows our packages.
        os.environ["PYTHONSAFEPATH"] = "1"  # ... in any process the command starts either.
        reexec_with_fast_malloc([sys.executable, "-P", "-m", "flywheel.flows.cli", *sys.argv[1:]])
    try:
        result = typer.main.get_command(app).main(args=argv, prog_name="flywheel", standalone_mode=False)
    except typer.TyperException as err:  # Typer's vendored click: usage errors (exit_code 2), file errors (1).
        _fail(click_error_line(err), err.exit_code)
    except typer.Abort:
        _fail("aborted", 1)
    except Exception as err:  # The CLI's promise: any failure is a line, never a traceback.
        if state.verbose and not isinstance(err, USER_ERRORS):
            logging.getLogger(__name__).debug("traceback", exc_info=err)
        _fail(failure_line(err, USER_ERRORS, state.verbose), 1)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":  # `accelerate launch -m flywheel.flows.cli ...` (multi-GPU SFT) runs the module.
    main()
