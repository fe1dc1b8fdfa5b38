"""dxpool.broker: the control plane's server, in four wings above placement.

Imports run one way, top to bottom: a wing may import the wings below it, never one
above, and no two modules import each other (``lint-imports`` checks both, see
``[tool.importlinter]`` in pyproject.toml). This file and the wings' own ``__init__``
modules import nothing, so the graph the tools see is the code's.

**api** (:mod:`dxpool.broker.api`): the gRPC edge and the broker process. The server
(:mod:`~dxpool.broker.api.server`) wires the store, cache, loops and services together;
the ``*_service`` modules serve the RPCs; what every call passes through (authentication,
size limits and decoding, audit, streams, health, reflection) lives beside them, as do
the agent port and the watch fan-out. May import control, nodes, state and placement.

**control** (:mod:`dxpool.broker.control`): the loops. The node controller turns agents'
reports into node and GPU state; the elected leader's duties serve the queue
(dispatcher), carry out preemption notices, drive drains and fence GPUs of lost hosts
through the box fabric; agent sessions keep hosts alive. May import nodes, state and
placement.

**nodes** (:mod:`dxpool.broker.nodes`): the write paths. Compose, plan, resize, release
and forget nodes; gangs; queueing and admission; quotas and lending; the checks a request
passes before anything is read or written; the in-memory pool of the embedding API. May
import state and placement.

**state** (:mod:`dxpool.broker.state`): what the broker holds and how it commits. The
cache (an informer over every dxpool record in etcd), read-modify-commit over it (stm),
locks, record rules, the audit record a commit carries, metrics, pagination, and the
indexes and tallies kept current from cache events (placement index, queue, pool counts,
measured latency). May import placement.

**placement** (:mod:`dxpool.broker.placement`): the placement framework and its plugins,
pure functions of a snapshot. Imports no wing.

The compose path, in order:

1. ``NodeService.ComposeNode`` (:mod:`~dxpool.broker.api.node_service`) charges the node
   to the caller's tenant and hands it on: to
   ``QueuedComposer.compose`` (:mod:`~dxpool.broker.nodes.enqueue`) when the pool has a
   queue, which composes now or queues, else straight to
2. ``Composer.compose`` (:mod:`~dxpool.broker.nodes.compose`): ``_check`` validates the
   spec (:mod:`~dxpool.broker.nodes.validation`) and builds the placement request
   (:func:`~dxpool.broker.nodes.fit.placement_request`);
3. :func:`~dxpool.broker.placement.place` picks a host and GPUs on the snapshot of
   :class:`~dxpool.broker.state.placement_index.PlacementIndex`;
4. ``ComposeCommitter.commit`` (:mod:`~dxpool.broker.nodes.compose_commit`) writes the
   node, its GPUs, the host's allocation, the tenant's usage and the audit record in one
   etcd transaction that compares every record placement relied on; a lost compare
   places again;
5. the cache (:mod:`~dxpool.broker.state.cache`) applies the committed records from the
   etcd watch; the agent port (:mod:`~dxpool.broker.api.agent_service`) sends the
   host's new spec (``hostalloc/{host}``) down its agent's stream, and the agent
   attaches the GPUs and reports their status back;
6. the node controller (:mod:`~dxpool.broker.control.controller`) sees every GPU attached
   and verified and marks the node READY (or FAILED past its attach deadline).
"""
