"""The planning commands: `shardctl plan` (where every shard would go, or what is missing),
`manifests` (the objects the operator would create) and `crd`."""

from __future__ import annotations

import argparse
import sys

import yaml

from ..api.crd import render as render_crd
from ..objects.manifests import Context, Owner, check, desired_objects
from ..planning import PlanError, consider, picture, plan, shortfall
from ..planning.profile import profile_model
from ..planning.report import render_considered, render_plan
from ..settings import Settings
from .options import (
    EXIT_INFEASIBLE,
    add_model_args,
    add_pool_args,
    command,
    cpu_hint,
    inventory_for,
    model_dir_for,
    pick_model,
    planner_options,
    spec_for,
)


def cmd_plan(args: argparse.Namespace) -> int:
    model = pick_model(args.file, args.name)
    spec = spec_for(args, model)
    profile = profile_model(model_dir_for(args, model))
    inventory, options = inventory_for(args, model), planner_options(args)
    name = model.metadata.name
    try:
        result = plan(profile, spec, inventory, options)
    except PlanError as err:
        err = cpu_hint(err, args, profile, spec, inventory, options)
        picture.write(picture.infeasible_svg(err, f"{name} does not fit"), f"ShardedModel {name}: no plan",
                      f"{err.reason}: {err.message}", args.svg, args.html)
        if args.explain and err.reason == "InsufficientCapacity":
            print(render_considered(consider(profile, spec, inventory, options)[2], None))
        raise err from None
    text = render_plan(result, profile, inventory)
    picture.write(picture.plan_svg(result), f"ShardedModel {name}: the plan", text, args.svg, args.html)
    if args.json:
        print(result.to_json())
    else:
        print(f"ShardedModel {name}")
        print(text)
        if args.explain:
            print()
            print(render_considered(consider(profile, spec, inventory, options)[2], result))
    if missing := shortfall(result, profile, spec, inventory, options):  # the groups that fit are planned
        print(f"shardctl: InsufficientCapacity: {missing.message}", file=sys.stderr)
        return EXIT_INFEASIBLE
    return 0


def cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(render_crd())
    return 0


def cmd_manifests(args: argparse.Namespace) -> int:
    """Print the objects the operator would create, built by the operator's own pure builders."""
    model = pick_model(args.file, args.name)
    spec = spec_for(args, model)
    ctx = Context(owner=Owner(name=model.metadata.name, namespace=model.metadata.namespace or args.namespace),
                  spec=spec, default_image=args.image or Settings().worker_image,
                  network_policy=not args.no_network_policy)
    check(ctx)
    profile = profile_model(model_dir_for(args, model))
    inventory, options = inventory_for(args, model), planner_options(args)
    try:
        result = plan(profile, spec, inventory, options)
    except PlanError as err:
        raise cpu_hint(err, args, profile, spec, inventory, options) from None
    sys.stdout.write(yaml.safe_dump_all(desired_objects(ctx, result), sort_keys=False))
    return 0


def add_plan(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "plan", "show where every shard of a ShardedModel would go",
                "Plan a ShardedModel for a pool of devices (Kubernetes Nodes, a device list, or this machine) "
                "and print\nwhere every rank goes and what it holds. Exits 2 when not every replica fits, "
                "saying why and what\nwould fit (each suggestion checked by planning again).",
                ["shardctl plan -f examples/llama-70b.yaml --nodes examples/nodes.yaml",
                 'shardctl plan -f examples/llama-70b.yaml --devices "a:80GiB*4,b:48GiB*4@0.86" --explain',
                 'shardctl plan -f examples/local-demo.yaml --devices "localhost:256MiB*2" --svg plan.svg'])
    add_model_args(p)
    add_pool_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON (docs/planner.md)")
    p.add_argument("--explain", action="store_true", help="also list the layouts compared and why each lost")
    p.add_argument("--svg", metavar="FILE", help="also draw the placement (or what is missing) as SVG "
                                                 "(default: not drawn)")
    p.add_argument("--html", metavar="FILE", help="also draw it as a self-contained HTML page, with the text "
                                                  "(default: not drawn)")
    p.set_defaults(func=cmd_plan)


def add_manifests(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "manifests", "print the Kubernetes objects the operator would create",
                "Print the objects the operator would create for a ShardedModel on a pool, built by the "
                "operator's\nown builders: pods, headless Services, the plan ConfigMap, the NetworkPolicy.",
                ["shardctl manifests -f examples/llama-70b.yaml --nodes examples/nodes.yaml",
                 'shardctl manifests -f examples/shardedmodel.yaml --model-dir DIR --devices "a:24GiB*2" -n prod'])
    add_model_args(p)
    p.add_argument("-n", "--namespace", default="default", metavar="NS", help="namespace when the ShardedModel "
                                                                             "names none")
    p.add_argument("--image", metavar="IMAGE",
                   help="worker image when spec.worker.image is unset (default: the operator's, "
                        "SHARD_OPERATOR_WORKER_IMAGE or its built-in one)")
    p.add_argument("--no-network-policy", action="store_true",
                   help="leave out the model's NetworkPolicy "
                        "(as an operator installed with networkPolicy.enabled=false)")
    add_pool_args(p)
    p.set_defaults(func=cmd_manifests)


def add_crd(sub: argparse._SubParsersAction) -> None:
    p = command(sub, "crd", "print the ShardedModel CustomResourceDefinition",
                "Print the ShardedModel CustomResourceDefinition (the chart installs the same one).",
                ["shardctl crd | kubectl apply -f -"])
    p.set_defaults(func=cmd_crd)
