"""Two coding agents at once on one model: their scripted sessions (``bench/bench_agent.py``'s, two seeds) replayed
interleaved, one engine request at a time against the continuous-batching step loop.

Each agent sends its next request when the reply to its last one is complete (no think time), so the two sessions
compete for the engine the whole run. Both modes reuse KV rows the same way (the radix prefix cache, anchors made and
restored at message boundaries, ``Model.generate``'s and the step loop's shared ``Model.adopt_prefix``):

* ``single``: one request at a time, first come first served (the server's default worker): an agent's request that
  arrives while the other's runs waits for it; ``Model.generate(reuse_cache=True, boundaries=...)``;
* ``batched``: :class:`freetoken.engine.batching.step_loop.StepLoop` with two seats: both agents' requests run in the
  same steps (a prompt's chunks beside the other's decode tokens).

Per mode: the wall time of both sessions, the tokens prefilled (the prompt tokens not reused) and reused, time to
first token (from the request's arrival: waiting included) p50 / p90 / max, per agent and in all, and whether the
replies agree with the single mode's (greedy; batched products round differently in float32, so a rare tie may
flip a token). Scripted replies: what the model generates is thrown away, the next request carries the script's.

    python bench/bench_two_agents.py                      # the bundled model, cpu, bench_agent's default sessions
    python bench/bench_two_agents.py --turns 6 --max-tokens 32
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_agent  # noqa: E402 - the sessions are bench_agent's


def sessions(model, args):
    """The two agents' requests (bench_agent's sessions for seeds ``args.seed`` and ``args.seed + 1``), with the
    message boundaries of each."""
    from freetoken.engine.generation.chat import ChatTemplate, _special_tokens, message_boundaries

    template = ChatTemplate.chatml(_special_tokens(model))

    def encode(text):
        return model.encode(text, add_special_tokens=False)

    def render(messages):
        return template.render(messages, add_generation_prompt=True)

    out = []
    for seed in (args.seed, args.seed + 1):
        agent = argparse.Namespace(**{**vars(args), "seed": seed})
        reqs, _, _, _ = bench_agent.fit_session(encode, render, agent, model.decoder.ctx)
        for r in reqs:
            r["bounds"] = message_boundaries(template, r["messages"], encode, r["ids"])
        out.append(reqs)
    return out


def run_single(model, agents, max_tokens: int) -> list[dict]:
    """One request at a time, first come first served: the agents' requests alternate while both have work."""
    from freetoken.engine.decoding.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    pending = [0] * len(agents)  # each agent's next request
    arrived = [0.0] * len(agents)  # when it arrived (the agent's last reply ended then)
    rows, queue = [], list(range(len(agents)))
    t0 = time.perf_counter()
    while queue:
        a = queue.pop(0)
        r = agents[a][pending[a]]
        start = time.perf_counter()
        gen = model.generate(r["ids"], max_tokens, greedy, reuse_cache=True, boundaries=r["bounds"])
        toks, first = [], None
        for tok in gen:
            first = first or time.perf_counter()
            toks.append(int(tok))
        end = time.perf_counter()
        st = gen.stats
        rows.append(dict(agent=a, request=pending[a], kind=r["kind"], prompt=len(r["ids"]), prefilled=st.prompt_tokens,
                         cached=st.cached_tokens, ttft=first - t0 - arrived[a], wait=start - t0 - arrived[a],
                         tokens=toks))
        pending[a] += 1
        arrived[a] = end - t0
        if pending[a] < len(agents[a]):
            queue.append(a)
    return rows


def run_batched(model, agents, max_tokens: int) -> list[dict]:
    """Both agents in the step loop, each submitting its next request when its last one ends."""
    from freetoken.engine.batching.step_loop import StepLoop
    from freetoken.engine.decoding.sampling import SamplingParams

    greedy = SamplingParams(temperature=0.0)
    loop = StepLoop(model, max_seqs=len(agents))
    pending = [0] * len(agents)
    live, rows = {}, []
    t0 = time.perf_counter()

    def submit(a):
        r = agents[a][pending[a]]
        req = loop.submit(r["ids"], max_tokens, greedy, anchor=None, boundaries=r["bounds"])
        live[id(req)] = dict(agent=a, request=pending[a], kind=r["kind"], prompt=len(r["ids"]),
                             arrived=time.perf_counter() - t0, first=None, req=req)

    for a in range(len(agents)):
        submit(a)
    while loop.has_work:
        for ev in loop.step():
            info = live[id(ev.request)]
            if ev.token is not None and info["first"] is None:
                info["first"] = time.perf_counter() - t0
            if ev.finish_reason is not None:
                req = live.pop(id(ev.request))["req"]
                a = info["agent"]
                rows.append(dict(agent=a, request=info["request"], kind=info["kind"], prompt=info["prompt"],
                                 prefilled=req.stats.prompt_tokens, cached=req.stats.cached_tokens,
                                 ttft=info["first"] - info["arrived"], wait=float("nan"), tokens=list(req.output)))
                pending[a] += 1
                if pending[a] < len(agents[a]):
                    submit(a)
    return rows


def _summary(rows, wall) -> dict:
    ttft = np.array([r["ttft"] for r in rows])
    return dict(wall=wall, prefilled=sum(r["prefilled"] for r in rows), cached=sum(r["cached"] for r in rows),
                prompt=sum(r["prompt"] for r in rows), p50=float(np.percentile(ttft, 50)),
                p90=float(np.percentile(ttft, 90)), max=float(ttft.max()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model path (default: the bundled model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--turns", type=int, default=12)
    ap.add_argument("--calls-per-turn", type=int, default=1)
    ap.add_argument("--retries", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=3000)
    ap.add_argument("--result-tokens", type=bench_agent._range_arg, default=(300, 2000), metavar="LO,HI")
    ap.add_argument("--target-tokens", type=int, default=bench_agent.LEGACY_TARGET,
                    help=f"each session's final prompt near this many tokens (default {bench_agent.LEGACY_TARGET})")
    ap.add_argument("--side-tokens", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per request")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import freetoken

    model = freetoken.load(args.model, device=args.device, kv_sequences=2)
    agents = sessions(model, args)
    list(model.generate(agents[0][0]["ids"][:300], 2, None))  # warm-up
    results = {}
    for mode, run in (("single", run_single), ("batched", run_batched)):
        bench_agent.clear(model)
        t0 = time.perf_counter()
        rows = run(model, agents, args.max_tokens)
        results[mode] = (rows, _summary(rows, time.perf_counter() - t0))
    bench_agent.clear(model)
    ref = {(r["agent"], r["request"]): r["tokens"] for r in results["single"][0]}
    same = sum(ref[r["agent"], r["request"]] == r["tokens"] for r in results["batched"][0])
    print(f"{args.model or 'bundled model'}, device {args.device}, {os.cpu_count()} CPUs "
          f"({platform.processor() or platform.machine()}); two agents, {len(agents[0])} + {len(agents[1])} requests, "
          f"final prompts {len(agents[0][-1]['ids'])} / {len(agents[1][-1]['ids'])} tokens, {args.max_tokens} "
          "tokens a reply")
    print("| mode | wall s | prompt tokens | prefilled | reused | TTFT p50 s | TTFT p90 s | TTFT max s |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, (_, s) in results.items():
        print(f"| {mode} | {s['wall']:.2f} | {s['prompt']} | {s['prefilled']} | {s['cached']} | {s['p50']:.3f} | "
              f"{s['p90']:.3f} | {s['max']:.3f} |")
    single, batched = results["single"][1], results["batched"][1]
    print(f"batched / single: wall {batched['wall'] / single['wall']:.2f}x, TTFT p50 "
          f"{batched['p50'] / single['p50']:.2f}x; replies equal to the single mode's: {same} of "
          f"{len(results['batched'][0])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
