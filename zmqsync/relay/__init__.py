"""Relays: carry a bus's versions to the buses of other hosts over torch.distributed.

Shared memory ends at the host. A `RelayRoot` on the trainer's host and one `Relay` per
other host form a *tree*: the root reads each version of the root bus and sends its
flat slot bytes to every relay with torch.distributed (gloo for CPU tensors, NCCL through
a CUDA staging buffer); each relay lands the bytes in a free slot of its own host's bus
and publishes them there under the same version number::

    host A (root)                             host B, C, ... (one relay each)
    trainer: Publisher("policy")              Relay(name="policy")
        |  shared memory                        |  owns Publisher("policy") on this host
    RelayRoot: Subscriber "relay-root"          |  shared memory
        (alias, manual)  ==== torch.distributed ====>  local workers: Subscriber("policy")

Three planes, each with the tool made for it:

* **rendezvous** (`_rendezvous`): a torch ``TCPStore`` hosted by the root at
  ``MASTER_ADDR:MASTER_PORT`` (``init_method="env://"``, the default, or
  ``"tcp://host:port"``: the root's `Tree` and each relay's `Branch` name it; each side
  takes one such object, holding only the options that apply to it, see `_options`). It
  also tells relays where the two ZeroMQ sockets are.
* **control** (`_messages`, `_root_agent`, `_host_agent`): ZeroMQ, ROUTER at the root,
  DEALER at each relay, both owned by agent threads: join, generations, heartbeats,
  reports. Per version, a second pair carries the "version v is on its way" notice and
  the relay's reports straight between the threads that act on them (each thread
  hand-off cost 0.1–0.3 ms on two busy cores, and a 4 MiB version had five). msgpack
  maps validated field by field (a `MessageSet` of the protocol module); nothing
  received is ever unpickled. The TCPStore and gloo themselves have no authentication:
  run relays on a trusted cluster network (a non-loopback address needs
  ``insecure=True``, stated explicitly).
* **data** (`_wire`): one torch.distributed process group per *generation*: a small
  header tensor, then the slot bytes in chunks, each a send/recv pair from the root to
  each relay, each wait with a timeout.

The root's bookkeeping of the tree (who is on it, which generation they form, who has
and acked which version, what a deadline decides) is `_membership.Membership`, an
object without I/O that its socket loops feed and its tests drive directly.

Theory of operation (the invariants the code keeps):

1. **Collectives are never waited for on a thread that must stay responsive.**
   torch.distributed collectives do not time out gracefully on their own (gloo raises
   after the group's timeout and leaves the group unusable; NCCL, without its watchdog,
   waits forever; ``abort()`` on a gloo group hangs). So the root runs them on a
   per-generation executor thread and waits for them with a `Deadline`; a relay waits
   on its data thread. Every wait carries a timeout (``Tree(collective_timeout=)``, by
   default about the time it takes to declare a silent relay lost), which bounds how long
   a hung peer can hold the others. Liveness and reports travel on ZeroMQ, so a stuck
   collective never silences a heartbeat.
2. **A generation is a fixed member list with a fresh process group.** Any failure (a
   relay dead or silent for ~6 heartbeats, a collective error or timeout, an eviction,
   a join) ends the generation: the root drops its group (gloo then closes its sockets,
   so the survivors' pending receives fail at once instead of at their timeout), asks
   every connected relay to PREPARE, and COMMITs the next generation with those that
   answered READY in time. A relay that answers late, or restarts, joins the next one.
3. **The root acks a version on its bus only when the tree has it**: with
   ``ack="relays"`` once every relay of the generation announced it on its own bus; with
   ``ack="tree"`` once every relay's local workers acked it (each relay reports after
   its own publish's wait, under its own `timeout` and `on_timeout`). A relay that
   misses the root's deadline is evicted (``on_timeout="evict"``: the root acks without
   it and the relay re-joins) or kept (``"raise"``: the root records a PublishTimeout and
   acks once the relay has the version, so a trainer with a shorter deadline sees its
   ``publish()`` time out on the relay-root worker).
4. **Bytes are never torn.** The root sends from the slot its subscriber aliases, which
   the root publisher does not rewrite while it is held (the root bus needs slots >= 2).
   A relay receives straight into a slot of its bus that no local worker holds (the core
   publisher's rule, so the relay costs no extra copy; the slot's seqlock is marked
   "being written" before its receives are posted, so even a reader that is no longer a
   holder, an evicted worker finishing a copy, sees the bytes change under it; when
   local alias workers hold every slot it receives into a staging buffer instead, so
   that the transfer never waits for local workers). A header that precedes the data,
   checked before the slot is marked complete, proves the bytes belong to the announced
   version; a version whose transfer fails is never announced.

Local workers of a relay that dies keep their last version (the ordinary
dead-publisher behaviour) and re-join when the relay restarts on the host.
"""

from ._carrier import Relayed
from ._host import Relay
from ._messages import RelayInfo
from ._options import Branch, Tree
from ._root import RelayRoot
from ._root_agent import inspect_relays

__all__ = ["Branch", "Relay", "RelayInfo", "RelayRoot", "Relayed", "Tree", "inspect_relays"]
