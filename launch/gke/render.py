"""The JobSets of a podrun job on GKE, from launch/gke/jobset-<single|multi>-host.yaml: each $name
of the template filled in as JSON (a YAML scalar or flow sequence), so podrun's arguments reach
the pods exactly as given; the multi-host template once a slice. The standard library only:
launch/gke/gke.sh runs it anywhere.

    python3 launch/gke/render.py single-host --name=podrun --image=IMAGE --accelerator=... \\
        --topology=2x4 --chips=8 --hosts=1 --slices=16 --parts=256 --retries=3 -- <podrun arguments>

Checks what JobSet's admission webhook checks of the names (a DNS-1035 label; every Job and pod
name it makes at most 63 characters), so a bad name fails here and not at `kubectl apply`.
"""

from __future__ import annotations

import argparse
import json
import re
import string
import sys
from pathlib import Path

TEMPLATES = {"single-host": "jobset-single-host.yaml", "multi-host": "jobset-multi-host.yaml"}
SERVICE_ACCOUNT = "podrun"  # created by `gke.sh cluster`, bound to buckets by `gke.sh grant`
DNS1035 = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
POD_SUFFIX = "-abcde"  # the random suffix of a pod's name, as JobSet's webhook counts it


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="render.py", description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=sorted(TEMPLATES))
    p.add_argument("--name", required=True, help="the JobSet's name")
    p.add_argument("--image", required=True)
    p.add_argument("--accelerator", required=True, help="cloud.google.com/gke-tpu-accelerator")
    p.add_argument("--topology", required=True, help="cloud.google.com/gke-tpu-topology")
    for count in ("chips", "hosts", "slices", "parts"):
        p.add_argument(f"--{count}", type=int, required=True)
    p.add_argument("--retries", type=int, required=True)
    p.add_argument("--output", help="write here instead of stdout")
    p.add_argument("podrun_args", nargs="+", help="podrun's arguments (after --)")
    return p.parse_args(argv)


def names_fit(name: str, shape: str, slices: int, parts: int, hosts: int) -> None:
    """Raises ValueError unless the Job and pod names JobSet makes from `name` are valid labels."""
    if not DNS1035.fullmatch(name) or len(name) > 63:
        raise ValueError(f"--name={name!r}: a JobSet name is a DNS-1035 label (lower-case letters, digits "
                         "and '-', starting with a letter, ending with a letter or digit)")
    if shape == "single-host":  # the JobSet NAME, its Job NAME-parts-0, pods NAME-parts-0-<part>-<suffix>
        longest = f"{name}-parts-0-{parts - 1}{POD_SUFFIX}"
    else:  # a JobSet NAME-<slice>, its Job NAME-<slice>-slice-0, pods NAME-<slice>-slice-0-<host>-<suffix>
        longest = f"{name}-{slices - 1}-slice-0-{hosts - 1}{POD_SUFFIX}"
    if len(longest) > 63:
        raise ValueError(f"--name={name!r} is too long: JobSet would name a pod {longest!r}, over 63 characters; "
                         f"use at most {len(name) - (len(longest) - 63)} characters")


def render(a: argparse.Namespace) -> str:
    for count in ("chips", "hosts", "slices", "parts"):
        if getattr(a, count) < 1:
            raise ValueError(f"--{count} must be 1 or more, not {getattr(a, count)}")
    if a.retries < 0:
        raise ValueError(f"--retries must be 0 or more, not {a.retries}")
    if (a.shape == "single-host") != (a.hosts == 1):
        raise ValueError(f"--hosts={a.hosts} does not fit the {a.shape} template")
    names_fit(a.name, a.shape, a.slices, a.parts, a.hosts)
    values = {
        "name": a.name, "image": a.image, "accelerator": a.accelerator, "topology": a.topology,
        "service_account": SERVICE_ACCOUNT, "chips": a.chips, "hosts": a.hosts, "slices": a.slices,
        "parts": a.parts, "retries": a.retries,
    }
    fields = {k: json.dumps(v) for k, v in values.items()}
    # the items of a flow sequence the template closes: [$podrun_args, "--config.io.parts=..."]
    fields["podrun_args"] = ", ".join(json.dumps(arg) for arg in a.podrun_args)
    text = (Path(__file__).parent / TEMPLATES[a.shape]).read_text()
    # inside a quoted scalar ("--config.io.parts=$parts", value: "$slices") a number goes in bare
    if a.shape == "single-host":
        return string.Template(text).substitute(fields)
    lines = text.splitlines(keepends=True)
    n = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    header, body = string.Template("".join(lines[:n])), string.Template("".join(lines[n:]))
    docs = [body.substitute(fields, jobset=json.dumps(f"{a.name}-{r}"), replica=r) for r in range(a.slices)]
    return header.substitute(fields) + "---\n".join(docs)


def main(argv: list[str]) -> int:
    a = parse(argv)
    try:
        manifest = render(a)
    except ValueError as e:
        print(f"render.py: error: {e}", file=sys.stderr)
        return 2
    if a.output:
        Path(a.output).write_text(manifest)
    else:
        sys.stdout.write(manifest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
