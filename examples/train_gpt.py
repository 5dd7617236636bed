"""The main job: the reference GPT — or any local transformers causal LM — trained on real text over a
3D mesh of CPU processes.

    python examples/train_gpt.py                                    # data x pipe x tensor = 2x2x2: 8 processes
    python examples/train_gpt.py mesh=dp2_tp2 parallel=zero3 train.precision=bf16
    python examples/train_gpt.py mesh=hsdp2x2 parallel=hsdp data.path=my.txt train.steps=500
    torchrun --nnodes 2 --nproc-per-node 4 --node-rank R --master-addr HOST --master-port 29500 examples/train_gpt.py
                                                                    # the same run over two nodes (R = 0, 1)
    python examples/train_gpt.py checkpoint.every=50 checkpoint.resume=auto    # stop any time; run again to continue
    python examples/train_gpt.py model=hf model.path=FOLDER mesh=dp2_tp2 parallel=tp data=dataset data.path=x.jsonl
                                                                    # a transformers folder on a local dataset
    python examples/train_gpt.py model=hf model.path=FOLDER lora=r16 quant=int8 mesh=dp2 parallel=zero3
                                                                    # LoRA adapters over its frozen int8 base

Hydra composes ``conf/config.yaml`` (groups ``mesh`` = ``meshes/*.yaml``, ``parallel``, ``model``,
``train``, ``data``, ``lora``, ``quant``); the configuration becomes the library's ``RunConfig`` at this edge and is checked
whole before any process starts — an unknown preset or key, a preset naming an axis the mesh lacks, a
model the layout cannot split, a missing or corrupt dataset, a mesh that is not the torchrun world:
each is a short message naming the config key, exit code 2. Started plainly, the program spawns the
mesh's processes itself; under ``torchrun`` it uses that world unchanged.

Rank 0 prints the plan (compact), shows a progress bar (loss, tokens/s, step time, ETA; on stderr)
and a log line every ``train.log_every`` steps — where the output is not a terminal (a log file, CI)
no bar, but the same plain line every ``train.log_every`` steps or 30 s — and writes into the Hydra run directory
(``outputs/<date>/<time>/``): ``metrics.jsonl`` (one object per step: step, loss, lr, grad_norm,
tokens_per_s, step_ms, peak_rss per rank, bytes_per_axis rank 0 sent; with an expert axis tokens_per_expert
and expert_imbalance), ``plan.txt``, ``loss.png``, ``memory.png`` (per rank, planned vs measured parameters,
gradients, optimizer state, activations), ``timeline.png`` (the last step of a pipeline), ``experts.png`` (with
an expert axis: each MoE layer's tokens per expert per step, and the imbalance) and ``summary.json``.

A transformers model (``model=hf model.path=<folder>``: ``config.json``, safetensors, tokenizer
files; ``examples/make_tiny_hf.py`` makes a small one offline) trains the same way: each rank builds
it with its parameters on the meta device, ``sl.parallelize(..., init=False)`` and
``engine.load_pretrained(folder)`` read only its pieces; the folder's own tokenizer reads each data
rank's share of the text (the stdlib, a file, or ``data=dataset``: text, JSON lines or parquet
through the ``datasets`` library); the loss is the model's own; at the end ``engine.save_pretrained``
writes the trained model to ``hf/`` in the run directory (``from_pretrained`` loads it).
With ``lora=r8``/``r16`` (and ``quant=int8``/``int4`` for a quantized frozen base) each rank loads the
folder, quantizes it and wraps it in seeded PEFT LoRA adapters (``shardlib/frontend/finetune.py``);
only the adapters train, and at the end ``engine.save_pretrained`` writes PEFT's adapter folder to
``adapter/`` in the run directory (``PeftModel.from_pretrained(base, folder)`` loads it).

Checkpoints: ``checkpoint.every=N`` saves the whole training state every N steps (and after the last)
into ``checkpoint.dir`` (``step-000123`` folders, a ``latest`` pointer replaced atomically: a run killed
mid-save keeps the previous one); ``checkpoint.resume=auto`` continues from the latest there — on any
mesh and layout — with the same batches (a batch is a function of its step), learning rate and
optimizer state, so a run stopped with Ctrl-C and started again follows the same loss curve.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

import shardlib as sl
from shardlib.cli.compose import check_overrides, whole_axes
from shardlib.frontend.config.run_config import ConfigError, RunConfig, run_config
from shardlib.frontend.launch.outcomes import WorkerError
from shardlib.frontend.plots.report import Progress, plot_expert_load, plot_loss, plot_memory, summary_lines
from shardlib.frontend.run import SavedActivations, Trainer, check
from shardlib.planner.pipeline_report import rank_activation_bytes
from shardlib.runtime.checkpoint.core import clean_partial, latest, save_step

NAME = "train_gpt.py"


def world_problems(run: RunConfig) -> list[str]:
    """Under torchrun the world is given: the mesh must be exactly that size."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and int(world) != run.mesh.size:
        return [f"mesh: mesh={run.mesh.name} has {run.mesh.size} ranks {run.mesh.shape}, but torchrun started "
                f"{world} (WORLD_SIZE) — expected --nnodes x --nproc-per-node = {run.mesh.size}, or a mesh preset of "
                f"{world} ranks."]
    return []


def rank_main(run: RunConfig, out: str) -> dict:
    import threading

    from tqdm import tqdm
    tqdm.set_lock(threading.RLock())   # not tqdm's multiprocessing lock (ours, datasets'): ranks leave with os._exit
    torch.set_num_threads(1)
    mesh = sl.Mesh(run.mesh.shape, **run.mesh.process_kwargs())
    trainer = Trainer(run, mesh)
    plan, engine, t = trainer.plan, trainer.engine, run.train
    lead = mesh.rank == 0
    out_dir = pathlib.Path(out)
    ck = run.checkpoint
    start = _resume(engine, ck, lead)
    if lead:
        text = plan.explain(max_params=8)
        (out_dir / "plan.txt").write_text(plan.explain(full=True) + "\n")
        source = run.data.path or "the stdlib source"
        data = (f"{len(trainer.text):,} tokens (data rank 0's share of {engine.data_size}) of {source}, by the "
                f"folder's tokenizer" if trainer.hf else f"{len(trainer.text) / 2**20:.1f} MiB of {source}")
        print(text + f"\n\ndata: {data}; {t.steps} steps of {t.batch} x {run.seq} tokens; writing to {out_dir}\n",
              flush=True)
    progress = Progress(t.steps, start, every=t.log_every, show=lead)
    metrics, saved, timeline = [], 0, []
    sink = open(out_dir / "metrics.jsonl", "w") if lead else contextlib.nullcontext()
    with sink as f:
        for i in range(start, t.steps):
            probe = SavedActivations(trainer.model) if i == min(start + 1, t.steps - 1) else contextlib.nullcontext()
            with probe:
                m = trainer.step(i)
            if isinstance(probe, SavedActivations):
                saved = probe.peak
            if i == t.steps - 1 and engine.pipe is not None:
                timeline = list(engine.timeline)
            metrics.append(m)
            if lead:
                f.write(json.dumps(m) + "\n")
                f.flush()
                progress.update(m)
            if ck.every and ((i + 1) % ck.every == 0 or i + 1 == t.steps):
                # a fine-tune's frozen base is rebuilt from its folder on resume: not rewritten every save
                where = save_step(engine, ck.dir, i + 1, keep=ck.keep, frozen=not trainer.tuned,
                                  extra={"mesh": run.mesh.name, "parallel": run.parallel.name})
                if lead:
                    print(f"saved {where}", flush=True)
    progress.close()
    if trainer.tuned and metrics:      # the adapters as PEFT's folder: PeftModel.from_pretrained(base, folder)
        engine.save_pretrained(out_dir / "adapter")
        if lead:
            print(f"saved the adapters to {out_dir / 'adapter'} (PeftModel.from_pretrained(base, that folder) loads "
                  f"them onto the base in {run.model.path})", flush=True)
    elif trainer.hf and metrics:       # the trained model as a transformers folder: from_pretrained loads it
        engine.save_pretrained(out_dir / "hf")
        if lead:
            print(f"saved the trained model to {out_dir / 'hf'} (AutoModelForCausalLM.from_pretrained loads it; "
                  f"its tokenizer is the one in {run.model.path})", flush=True)
    if not metrics:
        return {"losses": [], "agree": True, "out": str(out_dir)}
    # whole-run claims are checked across ranks, under torchrun too: every rank's losses and memory
    held = {k: v for k, v in engine.memory_held().items() if k != "buffers"}
    kinds = {k: engine.memory_held(kind=k)["total"] for k in ("device", "host", "disk")} if plan.offload else None
    mine = {"losses": [m["loss"] for m in metrics], "held": {**held, "activations": saved}, "timeline": timeline,
            "kinds": kinds}
    everyone = [None] * mesh.size
    if mesh.size > 1:
        import torch.distributed as dist
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    agree = all(e["losses"] == everyone[0]["losses"] for e in everyone)
    if lead:
        _report(run, plan, metrics, everyone, agree, out_dir)
    return {"losses": mine["losses"], "agree": agree, "out": str(out_dir)}


def _resume(engine, ck, lead: bool) -> int:
    """``checkpoint.resume``: load ``auto`` (the dir's latest, if any) or a given checkpoint; the step
    to continue from."""
    if not ck.resume:
        return 0
    path = latest(ck.dir) if ck.resume == "auto" else pathlib.Path(ck.resume)
    if path is None:
        if lead:
            print(f"checkpoint.resume=auto: no checkpoint in {ck.dir} yet — starting at step 0", flush=True)
        return 0
    extra = engine.load(path)
    if lead:
        print(f"resumed from {path} (saved on mesh={extra.get('mesh')} parallel={extra.get('parallel')}) at "
              f"step {engine.step_count}", flush=True)
    return engine.step_count


def _report(run: RunConfig, plan, metrics: list[dict], everyone: list[dict], agree: bool, out_dir: pathlib.Path) -> None:
    model = run.model.name + (f" ({run.model.path})" if run.model.kind == "hf" else "")
    title = f"mesh={run.mesh.name} parallel={run.parallel.name} model={model}"
    plot_loss(metrics, out_dir / "loss.png", title=title)
    planned = []
    for r in range(len(everyone)):
        p = plan.memory_per_rank(r)
        planned.append({"params": p["params"], "grads": p["grads"], "optimizer": p["optimizer"],
                        "activations": rank_activation_bytes(plan, r)})
    kinds = ""
    if plan.offload:        # the bars are the device's; each memory kind's bytes on rank 0 beside them
        from shardlib.comm.core import format_bytes
        kinds = "\nby memory kind on rank 0 (held / planned): " + ", ".join(
            f"{k} {format_bytes(everyone[0]['kinds'][k])} / {format_bytes(plan.memory_per_rank(0, kind=k)['total'])}"
            for k in ("device", "host", "disk"))
    plot_memory(planned, [e["held"] for e in everyone], out_dir / "memory.png",
                title=f"{title}\nmodel states: plan.memory_per_rank vs held; activations: the blocks' saved bytes "
                      "x live micro-batches (planned) vs the peak saved (measured)" + kinds)
    if any(m.get("tokens_per_expert") for m in metrics):       # the expert axis: each expert's load per step
        plot_expert_load(metrics, out_dir / "experts.png", title=f"{title}: tokens per expert")
    if everyone[0]["timeline"]:
        from shardlib.frontend.plots.timeline import plot_timeline
        from shardlib.planner.simulate import bubble_formula
        pp = plan.pipeline
        records = [r for e in everyone for r in e["timeline"]]
        plot_timeline(records, out_dir / "timeline.png", title=f"{title}: the last step",
                      compare={"formula": bubble_formula(pp.schedule, pp.size, pp.microbatches, pp.virtual)})
    lines = summary_lines(metrics)
    lines.append(f"the same loss on all {len(everyone)} ranks: {'yes' if agree else 'NO'}")
    if plan.offload:        # memory kinds: each kind's model-state bytes on rank 0, planned and held
        from shardlib.comm.core import format_bytes
        want = {k: plan.memory_per_rank(0, kind=k)["total"] for k in ("device", "host", "disk")}
        lines.append("model states by memory kind on rank 0 (" + ", ".join(f"{s} -> {k}" for s, k in plan.offload)
                     + "): " + ", ".join(f"{k} {format_bytes(everyone[0]['kinds'][k])} (planned {format_bytes(v)})"
                                         for k, v in want.items()))
    summary = {"config": {"mesh": run.mesh.name, "parallel": run.parallel.name, "model": run.model.name,
                          **({"model_path": run.model.path} if run.model.kind == "hf" else {})},
               "summary": lines, "first_loss": metrics[0]["loss"], "last_loss": metrics[-1]["loss"],
               "ranks_agree": agree, "steps": len(metrics),
               "memory": {"planned": planned, "measured": [e["held"] for e in everyone],
                          "kinds": [e["kinds"] for e in everyone]}}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print("\n" + "\n".join(lines) + f"\nwrote {', '.join(sorted(p.name for p in out_dir.iterdir()))} to {out_dir}",
          flush=True)


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def hydra_main(cfg: DictConfig) -> None:
    from hydra.core.hydra_config import HydraConfig
    run = run_config(OmegaConf.to_container(cfg, resolve=True))
    out = HydraConfig.get().runtime.output_dir
    try:
        results = sl.launch(rank_main, run.mesh.size, run, out)
    except KeyboardInterrupt:          # Ctrl-C: the ranks are gone; a save they left half-done goes too
        print(f"\n{NAME}: interrupted{_stopped(run, '; ')}", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    except WorkerError as e:           # a rank raised or died: the launcher's own message, not ours wrapped round it
        print(f"{NAME}: {e}{_stopped(run, chr(10))}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    res = results[0]
    if not res["losses"]:
        print(f"{NAME}: nothing to do — the checkpoint is at step {run.train.steps} already", flush=True)
        return
    if not res["agree"]:
        raise SystemExit(f"{NAME}: the ranks disagree on the loss")
    if os.environ.get("RANK", "0") == "0" and len(res["losses"]) > 1 and not res["losses"][-1] < res["losses"][0]:
        raise SystemExit(f"{NAME}: the loss did not go down ({res['losses'][0]:.4f} -> {res['losses'][-1]:.4f})")


def _stopped(run: RunConfig, sep: str) -> str:
    """The ranks are gone (Ctrl-C, or one failed): remove a save they left half-done; where a resume
    would continue from (after ``sep``), or nothing."""
    if not run.checkpoint.every:
        return ""
    clean_partial(run.checkpoint.dir)
    where = latest(run.checkpoint.dir)
    return f"{sep}checkpoint.resume=auto continues from {where}" if where else ""


def problems_of(argv: list[str]) -> list[str]:
    """Every problem of the command line ``argv``, found in this process before any rank starts."""
    try:
        run = run_config(check_overrides(argv))
        return check(run) + world_problems(run)
    except ConfigError as e:
        return e.problems


def main() -> None:
    """Check the whole configuration here, in one process, then hand over to Hydra (run directory)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")     # its advice on inputs we build is noise here
    sys.argv[1:] = whole_axes(sys.argv[1:])      # mesh.axes={...} replaces the preset's axes whole
    problems = problems_of(sys.argv[1:])
    if problems:
        print(f"{NAME}: " + (problems[0] if len(problems) == 1 else f"{len(problems)} problems in the configuration:\n"
                             + "\n".join(f"  - {p}" for p in problems)), file=sys.stderr)
        raise SystemExit(2)
    hydra_main()


if __name__ == "__main__":
    main()
