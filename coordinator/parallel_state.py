"""Process-wide parallel state: the world, TP, PP, DP, PCP, DCP and EP groups, no config object.

Typical use in each of N processes (under ``torchrun`` or any spawner)::

    from coordinator import parallel_state as ps
    ps.init_distributed_environment(world_size=4, rank=r,
                                    distributed_init_method="tcp://10.0.0.1:29500")
    ps.initialize_model_parallel(tensor_model_parallel_size=2,
                                 pipeline_model_parallel_size=2)
    y = ps.get_tp_group().all_reduce(x)
    ...
    ps.destroy_model_parallel(); ps.destroy_distributed_environment()

Rank layout is DP x PP x TP with TP varying fastest: global rank
``r = dp * (PP * TP) + pp * TP + tp``. With TP=2, PP=2 (world 4) the TP
groups are [0, 1] and [2, 3], the PP groups [0, 2] and [1, 3].

With ``enable_expert_parallel=True`` an expert-parallel group spans the
DP x TP ranks of each pipeline stage, ``ep_rank = dp * TP + tp`` (vLLM's
layout; see :mod:`coordinator.parallel.expert_parallel`). Prefill and decode context
parallelism (PCP, DCP) follow vLLM too: :mod:`coordinator.parallel.rank_mesh`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import numbers
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from coordinator.communication_op import (
    broadcast_tensor_dict,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
    tensor_model_parallel_gather,
    tensor_model_parallel_reduce_scatter,
)
from coordinator.errors import NotInitializedError
from coordinator.group.group_coordinator import GraphCaptureContext, GroupCoordinator, side_stream
from coordinator.group.registry import REGISTRY
from coordinator.group.setup import check_backend
from coordinator.parallel.model_groups import (
    count_nodes,
    get_all_model_groups,
    get_node_count,
    init_model_parallel_group,
    init_world_group,
    prepare_communication_buffer_for_model,
)
from coordinator.parallel.rank_mesh import RankMesh
from coordinator.parallel.world_init import (
    check_init_method,
    check_local_rank,
    check_same_world,
    env_local_rank_of,
    init_torch_distributed,
)
from shm_broadcast.checks import check_timeout
from shm_broadcast.ranks.agreement import agree
from shm_broadcast.ranks.group_adapter import object_group
from shm_broadcast.timeouts import default_timeout

__all__ = [
    "init_distributed_environment",
    "initialize_model_parallel",
    "ensure_model_parallel_initialized",
    "model_parallel_is_initialized",
    "get_world_group",
    "get_tp_group",
    "get_pp_group",
    "get_dp_group",
    "get_ep_group",
    "get_eplb_group",
    "get_etp_group",
    "get_engram_dp_group",
    "get_engram_dp_size",
    "get_pcp_group",
    "get_dcp_group",
    "get_context_model_parallel_group",
    "get_dcp_world_size_and_rank",
    "get_decode_context_model_parallel_world_size",
    "get_decode_context_model_parallel_rank",
    "get_prefill_context_model_parallel_world_size",
    "get_prefill_context_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_pipeline_model_parallel_world_size",
    "get_pipeline_model_parallel_rank",
    "destroy_model_parallel",
    "destroy_distributed_environment",
    "cleanup_dist_env_and_memory",
    "is_global_first_rank",
    "is_local_first_rank",
    "graph_capture",
    "set_custom_all_reduce",
    "in_the_same_node_as",
    "patch_tensor_parallel_group",
    "tensor_model_parallel_all_reduce",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_reduce_scatter",
    "tensor_model_parallel_gather",
    "broadcast_tensor_dict",
    "init_world_group",
    "init_model_parallel_group",
    "get_all_model_groups",
    "prepare_communication_buffer_for_model",
    "get_node_count",
]


def _int_arg(value: Any, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def init_distributed_environment(
    world_size: int = -1,
    rank: int = -1,
    distributed_init_method: str = "env://",
    local_rank: int = -1,
    backend: str = "gloo",
    timeout: datetime.timedelta | float | None = None,
    *,
    allow_pickle: bool = False,
) -> GroupCoordinator:
    """Initialise torch.distributed (if needed) and create the world group.

    Args:
        world_size: Number of processes; -1 reads ``WORLD_SIZE`` (env://).
        rank: This process's global rank; -1 reads ``RANK`` (env://).
        distributed_init_method: ``env://`` or ``tcp://host:port``.
        local_rank: Rank on this node; -1 reads ``LOCAL_RANK`` under env://, else
            uses the global rank.
        backend: Backend of the world group (``gloo``; ``nccl`` for GPUs).
        timeout: Seconds (or a timedelta, ``> 0``) that bounds every wait of
            the world group and, through :func:`initialize_model_parallel`,
            of the TP/PP/DP groups: gloo calls, shared-memory collectives,
            message-queue broadcasts, barriers, point-to-point. None: the
            ``GROUPCOORD_TIMEOUT`` environment variable, else 300 s (see
            :mod:`shm_broadcast.timeouts` for the precedence).
        allow_pickle: Opt the world group in to pickle for objects msgspec
            cannot carry (see :class:`GroupCoordinator`); off by default, and
            inherited by :func:`initialize_model_parallel`'s groups. Only
            between processes that trust each other.

    Returns:
        The world :class:`GroupCoordinator`.

    Raises:
        ValueError: Inconsistent arguments (e.g. tcp:// without rank/world_size),
            or the world group exists with another world size or timeout.
    """
    world_size = _int_arg(world_size, "world_size")
    rank = _int_arg(rank, "rank")
    local_rank = _int_arg(local_rank, "local_rank")
    backend = check_backend(backend, "backend")
    check_init_method(distributed_init_method)
    check_local_rank(local_rank)
    if not isinstance(allow_pickle, bool):
        raise TypeError(f"allow_pickle must be a bool, got {type(allow_pickle).__name__}")
    env_local_rank = env_local_rank_of(distributed_init_method) if local_rank == -1 else None
    seconds = check_timeout(timeout, positive=True)
    if not dist.is_initialized():
        wait_s = default_timeout() if seconds is None else seconds
        REGISTRY.gloo_pinned = init_torch_distributed(
            world_size, rank, distributed_init_method, backend, datetime.timedelta(seconds=wait_s))
    elif world_size >= 1 and world_size != dist.get_world_size():
        raise ValueError(
            f"torch.distributed is already initialised with world size "
            f"{dist.get_world_size()}, but world_size={world_size} was requested"
        )
    world = REGISTRY.world
    if world is not None:
        check_same_world(world, rank, local_rank, seconds, allow_pickle)
    if local_rank == -1:
        local_rank = dist.get_rank() if env_local_rank is None else env_local_rank
    if REGISTRY.world is None:
        world = GroupCoordinator(
            [list(range(dist.get_world_size()))],
            local_rank,
            backend,
            use_device_communicator=True,
            group_name="world",
            timeout=seconds,
            allow_pickle=allow_pickle,
        )
        try:
            nodes = count_nodes(world)
        except BaseException:
            world.destroy()  # registered only whole: a later call starts afresh
            raise
        REGISTRY.world, REGISTRY.node_count = world, nodes
        REGISTRY.timeout = seconds  # None: each group resolves the default itself
    return REGISTRY.world


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    pipeline_model_parallel_size: int = 1,
    data_parallel_size: int = 1,
    backend: str | None = None,
    *,
    allow_pickle: bool | None = None,
    enable_expert_parallel: bool = False,
    prefill_context_model_parallel_size: int = 1,
    decode_context_model_parallel_size: int | None = 1,
    enable_eplb: bool = False,
) -> None:
    """Create the TP, PP, DP, PCP and DCP groups, and the EP (and EPLB) groups when asked
    (collective over the world). The layout: :mod:`coordinator.parallel.rank_mesh`.

    The sizes' product must divide the world size; a larger world holds that
    many replicas of the layout, as in vLLM (no group spans two replicas).

    Args:
        tensor_model_parallel_size: TP size.
        pipeline_model_parallel_size: PP size.
        data_parallel_size: DP size.
        backend: Backend of the device groups (default: the world group's).
        allow_pickle: Opt the three groups (and the TP group's message queue)
            in to pickle; ``None`` (default) takes the world group's setting,
            which is off unless ``init_distributed_environment`` opted in.
        enable_expert_parallel: Also create the expert-parallel group: the
            DP x TP ranks of this rank's pipeline stage, ``ep_rank = dp * TP + tp``
            (:mod:`coordinator.parallel.expert_parallel`); :func:`get_ep_group` returns it.
        prefill_context_model_parallel_size: PCP size (vLLM's prefill context
            parallelism): PCP groups of ranks that differ only in their PCP
            coordinate; it multiplies the world size like the others.
        decode_context_model_parallel_size: DCP size (None: 1), adding no
            processes, as vLLM 0.33: without PCP it must divide the TP size
            (each TP group splits into groups of this many consecutive ranks);
            with PCP > 1 it must be 1, PCP or TP x PCP
            (:mod:`coordinator.parallel.rank_mesh`).
        enable_eplb: Also create the expert-load-balancing group (needs
            ``enable_expert_parallel``): the EP group's ranks in a group of
            their own, as vLLM's ``enable_eplb``, so that moving expert weights
            never pairs with the forward pass's calls on the EP group;
            :func:`get_eplb_group` returns it.

    Raises:
        TypeError: A size is not an int, ``allow_pickle`` is not a bool or
            None, ``enable_expert_parallel`` or ``enable_eplb`` is not a bool,
            or ``backend`` is not a str or None (an int there is refused by name: vLLM's order
            ``(tp, pp, pcp, dcp)``, whose context-parallel sizes go by keyword here).
        NotInitializedError: :func:`init_distributed_environment` was not called.
        ValueError: A size is below 1, the sizes' product does not divide
            the world size, the DCP size is not one the layout allows, or
            ``enable_eplb`` is set without ``enable_expert_parallel``.
        RuntimeError: Model parallel groups already exist.
    """
    if model_parallel_is_initialized():
        raise RuntimeError(
            "model parallel groups are already initialised; call destroy_model_parallel() "
            "first, or ensure_model_parallel_initialized(tp, pp) to check the sizes"
        )
    world = REGISTRY.world
    sizes = (tensor_model_parallel_size, pipeline_model_parallel_size, data_parallel_size,
             prefill_context_model_parallel_size, decode_context_model_parallel_size)
    try:
        _check_not_vllm_order(backend, "initialize_model_parallel")
        mesh = _checked_mesh(world, *sizes)
        if allow_pickle is not None and not isinstance(allow_pickle, bool):
            raise TypeError(f"allow_pickle must be a bool or None, got "
                            f"{type(allow_pickle).__name__}")
        if not isinstance(enable_expert_parallel, bool):
            raise TypeError("enable_expert_parallel must be a bool, got "
                            f"{type(enable_expert_parallel).__name__}")
        _check_eplb(enable_eplb, enable_expert_parallel)
        if backend is not None:
            check_backend(backend, "backend")
    except (TypeError, ValueError) as e:
        if world is not None:  # the peers are told instead of waiting in new_group
            agree(object_group(world.cpu_group), e, _IMP, world.unique_name)
        raise
    world = get_world_group()
    backend = str(dist.get_backend(world.device_group)) if backend is None else backend
    pickle_ok = world.allow_pickle if allow_pickle is None else allow_pickle
    agree(object_group(world.cpu_group), None, _IMP, world.unique_name,
          [dataclasses.astuple(mesh), backend, pickle_ok, enable_expert_parallel, enable_eplb])
    _create_groups(mesh, world, backend, pickle_ok, enable_expert_parallel, enable_eplb)


def _check_eplb(enable_eplb: Any, enable_expert_parallel: bool | None) -> None:
    """``enable_eplb`` is a bool, and set only with expert parallelism."""
    if not isinstance(enable_eplb, bool):
        raise TypeError(f"enable_eplb must be a bool, got {type(enable_eplb).__name__}")
    if enable_eplb and not enable_expert_parallel:
        raise ValueError("enable_eplb=True needs enable_expert_parallel=True: the EPLB group "
                         "holds the expert-parallel group's ranks")


def _check_not_vllm_order(backend: Any, fn: str) -> None:
    """Refuse an int where the backend goes: vLLM's ``fn(tp, pp, pcp, dcp, backend)``
    puts the context-parallel sizes third and fourth, where this module takes the
    DP size and the backend, so such a call would build another layout."""
    if isinstance(backend, numbers.Integral) and not isinstance(backend, bool):
        raise TypeError(
            f"backend must be a str such as 'gloo' or 'nccl' (or None), got int {backend!r}: "
            f"{fn}(tp, pp, dp, backend) takes the DP size third and the backend fourth, "
            f"unlike vLLM's {fn}(tp, pp, pcp, dcp); pass "
            f"prefill_context_model_parallel_size= and decode_context_model_parallel_size= "
            f"by keyword")


_IMP = "initialize_model_parallel"


def _checked_mesh(world: GroupCoordinator | None, tp: Any, pp: Any, dp: Any, pcp: Any,
                  dcp: Any) -> RankMesh:
    """The layout of these sizes, once each is an int >= 1 and (with a world
    group) their product divides its size: a larger world holds several
    replicas of the layout (vLLM's external data parallelism)."""
    names = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
             "data_parallel_size", "prefill_context_model_parallel_size",
             "decode_context_model_parallel_size")
    values = [_int_arg(1 if v is None and n.startswith("decode") else v, n)
              for n, v in zip(names, (tp, pp, dp, pcp, dcp), strict=True)]
    for name, size in zip(names, values, strict=True):
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")
    tp, pp, dp, pcp, dcp = values
    if world is None:
        return RankMesh(tp=tp, pp=pp, dp=dp, pcp=pcp, dcp=dcp)
    return RankMesh.for_world(world.world_size, tp=tp, pp=pp, dp=dp, pcp=pcp, dcp=dcp)


def _create_groups(mesh: RankMesh, world: GroupCoordinator, backend: str,
                   allow_pickle: bool, enable_expert_parallel: bool, enable_eplb: bool) -> None:
    """Create and register the model-parallel groups of ``mesh``, in one order on
    every rank. If one fails, those already made are destroyed."""
    kw = {"timeout": REGISTRY.timeout, "use_device_communicator": True,
          "allow_pickle": allow_pickle}
    plan: list[tuple[str, list[list[int]], dict[str, Any]]] = [
        ("tp", mesh.tp_groups(), {"use_message_queue_broadcaster": True}),
        ("pp", mesh.pp_groups(), {}), ("dp", mesh.dp_groups(), {}),
        ("pcp", mesh.pcp_groups(), {}),
        ("dcp", mesh.dcp_groups(), {"use_message_queue_broadcaster": True}),  # as vLLM's
    ]
    if enable_expert_parallel:
        plan.append(("ep", mesh.ep_groups(), {}))
    if enable_eplb:  # the EP ranks again, in a group of their own (as vLLM's)
        plan.append(("eplb", mesh.ep_groups(), {}))
    try:
        for attr, group_ranks, extra in plan:
            group = GroupCoordinator(group_ranks, world.local_rank, backend,
                                     group_name=attr, **kw, **extra)
            setattr(REGISTRY, attr, group)
        if REGISTRY.ep is not None:
            REGISTRY.ep.set_token_peers(_token_peers(mesh, world, backend, kw))
    except BaseException:
        destroy_model_parallel()
        raise


def _token_peers(mesh: RankMesh, world: GroupCoordinator, backend: str,
                 kw: dict[str, Any]) -> GroupCoordinator:
    """The group of the EP ranks that share this rank's TP position (what an MoE
    dispatch without sequence parallelism gathers over): a group that exists
    already (DP, PCP or EP itself), else one made for it (collective)."""
    mine = next(g for g in mesh.ep_token_groups() if world.rank in g)
    for group in (REGISTRY.dp, REGISTRY.pcp, REGISTRY.ep):
        if group is not None and group.ranks == mine:
            return group
    REGISTRY.ep_tokens = GroupCoordinator(mesh.ep_token_groups(), world.local_rank, backend,
                                          group_name="ep_tokens", **kw)
    return REGISTRY.ep_tokens


def ensure_model_parallel_initialized(
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    data_parallel_size: int | None = None,
    backend: str | None = None,
    *,
    enable_expert_parallel: bool | None = None,
    prefill_context_model_parallel_size: int = 1,
    decode_context_model_parallel_size: int | None = 1,
    enable_eplb: bool | None = None,
) -> None:
    """Initialise model parallel groups unless they exist; if they do, check the sizes.

    ``data_parallel_size`` None: 1 when creating, any when checking (vLLM's
    workers pass no DP size). ``enable_expert_parallel`` None: create no EP
    group, and accept existing groups with or without one; a bool: create or
    require that. ``enable_eplb`` likewise for the EPLB group.

    Raises:
        ValueError: Existing groups have other sizes, or do (not) have the EP
            or EPLB group ``enable_expert_parallel`` or ``enable_eplb`` asks for.
    """
    if not model_parallel_is_initialized():  # every argument is checked in its agreement step
        initialize_model_parallel(
            tensor_model_parallel_size, pipeline_model_parallel_size,
            1 if data_parallel_size is None else data_parallel_size, backend,
            enable_expert_parallel=(False if enable_expert_parallel is None
                                    else enable_expert_parallel),
            prefill_context_model_parallel_size=prefill_context_model_parallel_size,
            decode_context_model_parallel_size=decode_context_model_parallel_size,
            enable_eplb=False if enable_eplb is None else enable_eplb)
        return
    _check_not_vllm_order(backend, "ensure_model_parallel_initialized")
    sizes = (_int_arg(tensor_model_parallel_size, "tensor_model_parallel_size"),
             _int_arg(pipeline_model_parallel_size, "pipeline_model_parallel_size"),
             None if data_parallel_size is None
             else _int_arg(data_parallel_size, "data_parallel_size"),
             _int_arg(prefill_context_model_parallel_size, "prefill_context_model_parallel_size"),
             _int_arg(1 if decode_context_model_parallel_size is None
                      else decode_context_model_parallel_size,
                      "decode_context_model_parallel_size"))
    if enable_expert_parallel is not None and not isinstance(enable_expert_parallel, bool):
        raise TypeError("enable_expert_parallel must be a bool or None, got "
                        f"{type(enable_expert_parallel).__name__}")
    if backend is not None:
        check_backend(backend, "backend")
    if enable_eplb is not None and not isinstance(enable_eplb, bool):
        raise TypeError(f"enable_eplb must be a bool or None, got {type(enable_eplb).__name__}")
    for flag, arg, name, group in (
            (enable_expert_parallel, "enable_expert_parallel", "expert-parallel", REGISTRY.ep),
            (enable_eplb, "enable_eplb", "EPLB", REGISTRY.eplb)):
        if flag is not None and flag != (group is not None):
            raise ValueError(
                f"model parallel groups exist and {'have' if group is not None else 'have no'} "
                f"{name} group, but {arg}={flag} was requested; call "
                f"destroy_model_parallel() first to change that"
            )
    have = tuple(g.world_size for g in (get_tp_group(), get_pp_group(), get_dp_group(),
                                          get_pcp_group(), get_dcp_group()))
    if any(want is not None and want != got for want, got in zip(sizes, have, strict=True)):
        raise ValueError(
            f"model parallel groups exist with (tp, pp, dp, pcp, dcp) = {have}, but {sizes} "
            f"was requested; call destroy_model_parallel() first to change them"
        )


def model_parallel_is_initialized() -> bool:
    """Whether the TP, PP and DP groups exist."""
    return REGISTRY.tp is not None and REGISTRY.pp is not None and REGISTRY.dp is not None


def _need(group: GroupCoordinator | None, what: str, how: str) -> GroupCoordinator:
    if group is None:
        raise NotInitializedError(f"the {what} group is not initialised; call {how} first")
    return group


_MP_HOW = "coordinator.parallel_state.initialize_model_parallel(...)"


def get_world_group() -> GroupCoordinator:
    """The world group. Raises NotInitializedError before init_distributed_environment."""
    return _need(REGISTRY.world, "world",
                 "coordinator.parallel_state.init_distributed_environment(...)")


def get_tp_group() -> GroupCoordinator:
    """The tensor-parallel group of this process."""
    return _need(REGISTRY.tp, "tensor model parallel", _MP_HOW)


def get_pp_group() -> GroupCoordinator:
    """The pipeline-parallel group of this process."""
    return _need(REGISTRY.pp, "pipeline model parallel", _MP_HOW)


def get_dp_group() -> GroupCoordinator:
    """The data-parallel group of this process."""
    return _need(REGISTRY.dp, "data parallel", _MP_HOW)


def get_pcp_group() -> GroupCoordinator:
    """The prefill-context-parallel group of this process (size 1 unless asked for)."""
    return _need(REGISTRY.pcp, "prefill context parallel", _MP_HOW)


def get_dcp_group() -> GroupCoordinator:
    """The decode-context-parallel group of this process: consecutive ranks of its
    TP group (size 1 unless asked for)."""
    return _need(REGISTRY.dcp, "decode context model parallel", _MP_HOW)


#: vLLM's older name of :func:`get_dcp_group`.
get_context_model_parallel_group = get_dcp_group


def get_dcp_world_size_and_rank(enabled: bool = True) -> tuple[int, int]:
    """``(world_size, rank_in_group)`` of the decode-context-parallel group, or
    ``(1, 0)`` when not ``enabled`` or no such group is initialised (vLLM's
    attention backends ask this way)."""
    dcp = REGISTRY.dcp
    if not enabled or dcp is None:
        return 1, 0
    return dcp.world_size, dcp.rank_in_group


def get_ep_group() -> GroupCoordinator:
    """The expert-parallel group of this process (the DP x PCP x TP ranks of its stage).

    Raises:
        NotInitializedError: Model parallel groups do not exist yet, or were
            created without ``enable_expert_parallel=True``.
    """
    if REGISTRY.ep is not None:
        return REGISTRY.ep
    if model_parallel_is_initialized():
        raise NotInitializedError(
            "the expert parallel group is not initialised: expert parallelism is off "
            "(initialize_model_parallel was called without enable_expert_parallel=True); "
            "call destroy_model_parallel(), then initialize_model_parallel(..., "
            "enable_expert_parallel=True)"
        )
    raise NotInitializedError(
        "the expert parallel group is not initialised; call "
        "coordinator.parallel_state.initialize_model_parallel(..., enable_expert_parallel=True) "
        "first"
    )


def get_eplb_group() -> GroupCoordinator:
    """The expert-load-balancing group of this process: its EP group's ranks in a
    group of their own (vLLM's ``get_eplb_group``).

    Raises:
        NotInitializedError: Model parallel groups do not exist yet, or were
            created without ``enable_eplb=True``.
    """
    if REGISTRY.eplb is not None:
        return REGISTRY.eplb
    how = ("initialize_model_parallel(..., enable_expert_parallel=True, enable_eplb=True)")
    if model_parallel_is_initialized():
        raise NotInitializedError(
            "the EPLB group is not initialised: expert load balancing is off "
            "(initialize_model_parallel was called without enable_eplb=True); call "
            f"destroy_model_parallel(), then {how}")
    raise NotInitializedError(
        f"the EPLB group is not initialised; call coordinator.parallel_state.{how} first")


def get_etp_group() -> GroupCoordinator:
    """The group that shards one engram embedding table (vLLM's ``get_etp_group``).

    Without an engram configuration (this module takes none) vLLM makes it the
    TP group itself, and so does this: the TP group.
    """
    return _need(REGISTRY.tp, "engram tensor parallel", _MP_HOW)


def get_engram_dp_group() -> GroupCoordinator | None:
    """The data-parallel replicas that share one engram embedding table: None, as
    in vLLM without an engram configuration (every replica holds a whole copy)."""
    return None


def get_engram_dp_size() -> int:
    """How many data-parallel replicas share one engram embedding table: 1 (see
    :func:`get_engram_dp_group`)."""
    return 1


def get_tensor_model_parallel_world_size() -> int:
    """Size of the TP group."""
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    """This process's rank in its TP group."""
    return get_tp_group().rank_in_group


def get_pipeline_model_parallel_world_size() -> int:
    """Size of the PP group."""
    return get_pp_group().world_size


def get_pipeline_model_parallel_rank() -> int:
    """This process's rank in its PP group."""
    return get_pp_group().rank_in_group


def get_decode_context_model_parallel_world_size() -> int:
    """Size of the DCP group."""
    return get_dcp_group().world_size


def get_decode_context_model_parallel_rank() -> int:
    """This process's rank in its DCP group."""
    return get_dcp_group().rank_in_group


def get_prefill_context_model_parallel_world_size() -> int:
    """Size of the PCP group."""
    return get_pcp_group().world_size


def get_prefill_context_model_parallel_rank() -> int:
    """This process's rank in its PCP group."""
    return get_pcp_group().rank_in_group


def destroy_model_parallel() -> None:
    """Destroy the TP, PP, DP, PCP, DCP, EP and EPLB groups (no-op if absent).

    Their process groups are released before it returns, which ends their gloo
    threads and sockets (see :meth:`GroupCoordinator.destroy`).
    """
    for attr in ("tp", "pp", "dp", "pcp", "dcp", "ep", "eplb", "ep_tokens"):
        g = getattr(REGISTRY, attr)
        setattr(REGISTRY, attr, None)
        if g is not None:
            g.destroy()


def destroy_distributed_environment() -> None:
    """Destroy the world group and torch.distributed; the process may initialise again.

    Like :func:`destroy_model_parallel`, it releases the destroyed groups'
    process groups before it returns, which ends their gloo threads and sockets.
    """
    destroy_model_parallel()
    world, REGISTRY.world = REGISTRY.world, None
    REGISTRY.timeout = REGISTRY.node_count = None
    if world is not None:
        world.destroy()
    if dist.is_initialized():
        dist.destroy_process_group()
    REGISTRY.gloo_pinned = None


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Tear everything down (as vLLM's function of this name): the model-parallel
    groups, the world group and torch.distributed, then free cached memory.

    Args:
        shutdown_ray: Also shut Ray down, when Ray is installed and running.
    """
    if not isinstance(shutdown_ray, bool):
        raise TypeError(f"shutdown_ray must be a bool, got {type(shutdown_ray).__name__}")

    destroy_distributed_environment()
    if shutdown_ray:
        _shutdown_ray()
    gc.collect()  # tensors that only reference cycles hold, before the cache is emptied
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def _shutdown_ray() -> None:
    """``ray.shutdown()`` when Ray is imported here and running."""
    import sys

    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()


def is_global_first_rank() -> bool:
    """Whether this process is rank 0 of the world (True before any initialisation)."""
    world = REGISTRY.world
    if world is not None:
        return world.rank == 0
    return not dist.is_initialized() or dist.get_rank() == 0


def is_local_first_rank() -> bool:
    """Whether this process is the first rank of its node (its ``local_rank`` is 0;
    True before any initialisation)."""
    world = REGISTRY.world
    return world is None or world.local_rank == 0


def set_custom_all_reduce(enable: bool) -> None:
    """Turn the CUDA custom all-reduce on or off for groups created from now on.

    vLLM's worker calls this before creating its groups (off when its config
    disables the custom all-reduce). Groups that exist keep what they agreed
    at creation. Off here is off whatever a communicator's
    ``use_custom_allreduce`` says, like ``GROUPCOORD_DISABLE_CUSTOM_ALLREDUCE``;
    a group's ranks agree, so off on one rank is off for its groups. CPU
    groups have no custom all-reduce: it changes nothing for them.

    Args:
        enable: Whether the custom all-reduce may be built.

    Raises:
        TypeError: ``enable`` is not a bool.
    """
    from device_comms.cuda.custom_allreduce import eligibility

    eligibility.set_enabled(enable)


@contextlib.contextmanager
def graph_capture(device: torch.device | str | None = None) -> Iterator[GraphCaptureContext]:
    """Enter graph-capture mode on the TP and PP groups (one shared stream).

    Args:
        device: The device captured on (used for the stream on GPUs).
    """
    stream = None
    if device is not None and not isinstance(device, (torch.device, str, int)):
        raise TypeError(f"device must be a torch.device, a device string or an index, got "
                        f"{type(device).__name__}")
    try:
        if device is not None:
            torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must name a device, got {device!r} ({e})") from None
    caller = None
    if device is not None and torch.device(device).type == "cuda":
        on = torch.device(device)
        stream = side_stream(on)
        caller = torch.cuda.current_stream(on)
    ctx = GraphCaptureContext(stream)
    with get_tp_group().graph_capture(ctx), get_pp_group().graph_capture(ctx):
        yield ctx
    if caller is not None and stream is not None:
        caller.wait_stream(stream)  # work queued inside lands before the caller's next


def in_the_same_node_as(pg: Any, source_rank: int = 0) -> list[bool]:
    """For each rank of ``group``, whether it shares a node (``/dev/shm``) with ``source_rank``.

    Args:
        pg: A GroupCoordinator, a torch ProcessGroup or a StatelessProcessGroup.
        source_rank: Group rank to compare with.
    """
    from shm_broadcast.ranks.topology import in_the_same_node_as as _same

    if isinstance(pg, GroupCoordinator):
        pg = pg.cpu_group
    return _same(pg, source_rank)


@contextlib.contextmanager
def patch_tensor_parallel_group(tp_group: GroupCoordinator) -> Iterator[GroupCoordinator]:
    """Temporarily make ``tp_group`` the TP group (e.g. for a draft model)."""
    if not isinstance(tp_group, GroupCoordinator):
        raise TypeError(f"tp_group must be a GroupCoordinator, got {type(tp_group).__name__}")
    old, REGISTRY.tp = REGISTRY.tp, tp_group
    try:
        yield tp_group
    finally:
        REGISTRY.tp = old
