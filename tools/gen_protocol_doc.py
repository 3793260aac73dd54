"""Generate docs/protocol.md from the protocol's field tables (`zmqsync._protocol.FIELDS`,
and the relay channel's `MessageSet`, `zmqsync.relay._messages.RELAY`).

    python tools/gen_protocol_doc.py            # write docs/protocol.md
    python tools/gen_protocol_doc.py --check    # exit 1 if docs/protocol.md is stale

The field tables (type and range of every field) come from the checks `decode` runs, so
the reference cannot say "8 bytes" next to code that reads four. Constants in the prose
(header words, magic, timings, the XPUB welcome frame, segment names) are read from the
code too. What cannot be read from code (who sends what, on which socket, and what the
peer does with it) is written here, next to the renderer: edit it when the behaviour in
`_publisher.py` / `_subscriber.py` changes. `tests/test_protocol_doc.py` fails when
docs/protocol.md and `render()` differ.
"""

from __future__ import annotations

import argparse
import difflib
import inspect
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack

from zmqsync import _config
from zmqsync import _protocol as P
from zmqsync._buffers import header as H
from zmqsync._buffers import transport as T
from zmqsync._buffers.cpu import PREFIX, segment_name
from zmqsync._config import XPUB_WELCOME
from zmqsync._publisher import Publisher
from zmqsync.relay import _messages as R
from zmqsync.relay._rendezvous import control_key, data_key
from zmqsync.relay._wire import HEADER_MAGIC

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "protocol.md"

EXAMPLE_BUS = "3f9a0c1d2e4b5a69"
EXAMPLE_SESSION = "8c41d07f2b9e6a13"
RECORDS = (P.TensorSpec, P.BufferInfo, P.WorkerEntry)

# socket: (publisher side, subscriber side, what it carries)
SOCKETS = {
    "control": (
        "REP, bound at the address",
        "REQ, a fresh one per attempt",
        "HELLO → WELCOME or ERROR; INSPECT → STATE or ERROR",
    ),
    "events": (
        "XPUB, bound at `<address>.events`",
        'SUB, subscribed to everything (`""`)',
        "RECEIVE, STOP, HEARTBEAT",
    ),
    "acks": ("PULL, bound at `<address>.acks`", "PUSH", "ACK, HEARTBEAT, BYE"),
}

# Who sends each message, on which socket, and what comes back.
ROUTES: dict[type[Any], tuple[str, str]] = {
    P.Hello: ("subscriber → publisher", "control, REQ → REP; answered with WELCOME or ERROR"),
    P.Welcome: ("publisher → subscriber", "control, the REP's answer to HELLO"),
    P.Receive: ("publisher → every subscriber", "events, XPUB → SUB"),
    P.Stop: ("publisher → every subscriber", "events, XPUB → SUB"),
    P.Heartbeat: (
        "both ways",
        "events (publisher, XPUB → SUB) and acks (each subscriber, PUSH → PULL)",
    ),
    P.Ack: ("subscriber → publisher", "acks, PUSH → PULL"),
    P.Bye: ("subscriber → publisher", "acks, PUSH → PULL"),
    P.Inspect: ("anyone → publisher", "control, REQ → REP; answered with STATE or ERROR"),
    P.State: ("publisher → inspector", "control, the REP's answer to INSPECT"),
    P.Error: ("publisher → requester", "control, the REP's answer to a refused request"),
    P.Tap: ("publisher → sniffers", "tap, XPUB → SUB (only when the tap is on)"),
}

# What the peers do with each message, beyond its fields (from _publisher/_subscriber).
NOTES: dict[type[Any], str] = {
    P.Hello: """\
A subscriber sends an empty `bus`. A non-empty `bus` must be the publisher's own, or the
answer is ERROR (a publisher that restarted has a new `bus`). The publisher also answers
ERROR while it is closing. A worker id belongs to one live session: a HELLO with a
`worker_id` whose session is still alive (heard from within six heartbeats) is answered
ERROR `busy: worker id … is in use by a live worker …`, unless it proves it comes from
that session's process: by its `nonce` (a secret of 32 hex digits the subscriber draws
once and sends, unchanged, in every HELLO), or by that `session`. The nonce lets a
process re-join although the WELCOME of an earlier HELLO never reached it (its REQ gave
up first): the session that HELLO registered is its own. A worker dropped by the
publisher (a deadline under `on_timeout="evict"`, or silence) that had spoken keeps its
id for `max(5 s, 6 heartbeats)`: a HELLO for it from any other process meanwhile is
answered ERROR `busy: worker id … is kept for the process that held it …`; a member that
never spoke after its WELCOME holds its id against other processes for the first-word
time only (5 s, plus 0.2 ms per tensor). A HELLO whose `nonce` belonged
to a process that held the id before, while another process holds it now, is answered
ERROR `taken: worker id … belongs to another process now …`: final, a subscriber stops
re-joining and reports it. A new worker id from a peer (a process on ipc://, a host on
tcp://) that already holds `max_workers_per_peer` members, or past `max_workers`, is
answered ERROR `bus full: …`. A subscriber retries "busy" and "bus full" answers until
its deadline. When a
HELLO replaces a member, the new one gets a new `session`, messages carrying the old one
are ignored, and a STOP for the old session goes out on events (reason `replaced`). If
the old session belonged to the same process, the slot it may still compute with stays
protected until the new session acks or the old one goes silent. Acks count for the
process a publish was meant for: an ACK under the same `worker_id` from another process
does not satisfy a publish made before it joined.

HELLOs for a live worker's id, for a full bus, or while closing are refused before the
handshake budget is spent (`handshake_rate` per second, a burst of two seconds' worth);
a HELLO refused for the budget (`busy: too many handshakes`) gets its `worker_id` a place
in line, and the next handshakes go to the ids in line in the order they first asked.

`transport` is what the worker asks for: `"cuda"` when it computes on a GPU (or has no
model and sees one), else `"cpu"`. On a bus without CUDA buffers every worker reads the
CPU segment: the publisher records `"cuda"` as `"cpu"`, with the note
`{cpu_publisher}`.

When the WELCOME shows that CUDA IPC cannot work here (the publisher's GPU is not
visible, another PID namespace, no handle offered, the driver refuses the handle), the
subscriber sends a second HELLO with `transport` `"cpu"` and the reason in
`transport_note`, and uses only the answer to that one: the publisher then keeps the
CPU copy of its CUDA tensors current (and copies the current version there before it
answers). A worker that sees no GPU, or has CUDA IPC switched off, asks for `"cpu"` at
once, with the note `{no_gpu}` or `{disabled}`.""",
    P.Welcome: """\
`seq` is the seq of the last event sent before this answer: the subscriber drops every
RECEIVE and STOP with `seq <= WELCOME.seq`. `version` is in `slot` now. `events` and
`acks` are the endpoints actually bound (for `tcp://` they carry the port chosen by the
system): connect to these, never to a guessed address. `tap` is empty in this version.

Cross-field rules, checked by `decode`: at least one buffer; `slot < slots`; for each
buffer `header_bytes + slots × slot_bytes ≤ size`; for each manifest entry
`buffer < len(buffers)` and `offset + nbytes ≤ slot_bytes`.""",
    P.Receive: """\
Sent only after the slot's bytes and its header words are complete (see the seqlock
below). `seq` grows by exactly 1 per RECEIVE or STOP; a jump means events were missed
(the header still names the latest version, so nothing is lost but time).""",
    P.Stop: """\
`session` empty: the bus closes. The publisher then waits up to
{bye_wait} s for BYEs, stops answering, and unlinks its segments; subscribers keep the
last version they applied and report `stopped`. `session` set: the worker holding that
session is no longer a member: evicted by a publish that timed out with
`on_timeout="evict"` (reason `"evicted"`) or silent for too long (reason
`"silent too long"`), or a session dropped earlier whose worker still sends HEARTBEATs
(reason `"not on the bus"`: it missed the first STOP, sent before its subscription was
live; repeated at most once per beat, only for sessions the publisher issued). It may
HELLO again. Every other subscriber ignores a STOP for a session not its own (but still
counts its `seq`).""",
    P.Heartbeat: """\
From the publisher, on events, every `heartbeat` seconds: `seq` = last event seq sent,
`worker_id` and `session` empty, `version` = latest version. A subscriber that sees
`seq` above the last seq it processed has missed an event: it reads the latest
(version, slot) from the header and applies that.

From a subscriber, on acks, every `heartbeat` seconds: `seq` 0, its `worker_id` and
`session`, `version` = the version it computes with (-1 before the first).

Liveness: the publisher drops a member from which no ACK or HEARTBEAT came for
{beats} × `heartbeat` seconds (one not heard from since its WELCOME: {first_word} s at
least, for its handshake) and sends STOP with its session. A subscriber that hears
nothing of its bus on events for as long considers the publisher lost: it keeps
computing with the last whole version and tries a handshake at once, then one per
`heartbeat`, each given at least {rejoin_min} s (more while they fail). A
HEARTBEAT from another `bus` on the events endpoint means a new publisher serves the
address: handshake again (new bus, new buffers).""",
    P.Ack: """\
Sent after the handshake's first apply and after every version applied. Counted only
when `worker_id` and `session` name a current member and `version` is not newer than the
publisher's latest; anything else is counted as stale and ignored. An ACK also counts as
a heartbeat.""",
    P.Bye: """\
Sent on close. The publisher forgets the member, so the slots it held may be written
again and no publish waits for it.""",
    P.Inspect: """\
Used by `zmqsync inspect`, and by a starting publisher to find out whether another one
already serves its `ipc://` address (it refuses to start if one answers).""",
    P.State: """\
`workers[].last_seen` is seconds since that worker's last message, not a timestamp.
`counters` includes publishes, handshakes, acks, stale, rejected, timeouts, evictions,
lost, refused_ids (HELLOs refused for a live worker's id), throttled (refused for the
handshake budget), told_gone (STOPs sent again to dropped sessions still beating),
dropped_peers (a counter appears once it is non-zero), and always
`connections` (open now) and `refused_connections` (closed by the publisher because the
bus was full, or refused at the handshake because the peer connected faster than its
rate or its CURVE key is not allowed; see docs/security.md).""",
    P.Tap: """\
The tap is off by default (`Publisher(security=Security(tap=True))` or `ZMQSYNC_TAP=1`
turns it on); WELCOME and STATE name its endpoint. Each TAP wraps one frame the publisher
sent (`dir` "out") or received (`dir` "in"), valid or not, so a sniffer decodes it with
the same `decode` and sees rejected frames too (truncated to 4096 bytes). Handle bytes in
a WELCOME are replaced by empty bytes, and every `session` (HELLO, WELCOME, ACK,
HEARTBEAT, BYE, STOP) and `nonce` (HELLO) by a keyed hash of it, as long as the secret:
the same stand-in for the same secret, worthless on the bus.
The tap socket has a small high-water mark and `XPUB_NODROP`: when a sniffer is slow or
stopped the publisher's send fails at once and the frame is counted as `tap_dropped`;
the bus never waits for a sniffer.""",
    P.Error: """\
The REP socket answers every request, so a REQ peer never stays stuck in its
send/receive lockstep. A frame that does not decode, has more than one part, names
another bus, or is not a request (HELLO or INSPECT) is answered with ERROR and counted
as rejected. A subscriber's handshake raises `ProtocolError` with the reason.""",
    P.TensorSpec: """\
The tensor's bytes are in buffer `buffer`'s segment at
`header_bytes + slot × slot_bytes + offset`, `nbytes` long, C-contiguous, elements in
the host's byte order. Checked by `decode`: `key` not empty;
`nbytes = prod(shape) × itemsize` exactly (Python integers: no overflow); `stride`
equals the contiguous strides of `shape` (a 0-size dimension counts as 1 there);
`offset` is a multiple of {align}. Item sizes:

{dtypes}""",
    P.BufferInfo: """\
For `kind` `"cpu"`, `segment` is a file name inside the shared-memory directory
(`$ZMQSYNC_SHM_DIR`, default `{shm}`), never a path. The first buffer is always that CPU
segment: it holds the header, and room for every tensor of every slot at its offset,
CUDA tensors included (their CPU copy, kept current while a worker reads it).
`handle`, `device_uuid`, `pid_ns` and `ipc_note` are empty or 0 there.

A `"cuda"` buffer (one per GPU the weights live on; `TensorSpec.buffer` names it) is one
dedicated CUDA allocation of `size` bytes: `slots` slots of `slot_bytes`, after
`header_bytes` (0: the header stays in the CPU segment), `segment` empty. `handle` is the
{ipc_bytes}-byte `cudaIpcMemHandle_t` of that allocation (the buffer starts at its offset
0), or empty when the publisher cannot share it, with the reason in `ipc_note` (for
example expandable segments). `device_uuid` is the GPU's UUID (`GPU-<uuid>`): a
subscriber finds its local index by UUID, whatever its `CUDA_VISIBLE_DEVICES`. `pid_ns`
is the inode of the publisher's PID namespace (`/proc/self/ns/pid`; 0 when unknown). A
subscriber opens the handle once, while it handles the WELCOME (`cudaIpcOpenMemHandle`,
in torch `UntypedStorage._new_shared_cuda`), never afterwards; a RECEIVE is only sent
after the publisher's GPU copies into the slot have completed. Checked by `decode`: a
`"cuda"` `handle` is empty or exactly {ipc_bytes} bytes.""",
    P.WorkerEntry: """\
Only in STATE. `transport` is what the worker reads: `"cuda"` (it mapped the CUDA
buffers) or `"cpu"` (the CPU segment); `transport_note` is the reason a worker reads the
CPU copy of CUDA weights, as its HELLO gave it.""",
}

# The relay control channel (zmqsync/relay): who sends each message, and where.
RELAY_ROUTES: dict[type[Any], tuple[str, str]] = {
    R.Join: (
        "relay → root",
        "control, DEALER → ROUTER; answered with RELAY_ACCEPT or RELAY_REFUSE",
    ),
    R.Accept: ("root → relay", "control, ROUTER → DEALER"),
    R.Refuse: ("root → relay", "control, ROUTER → DEALER; also the answer to a bad inspect"),
    R.Prepare: (
        "root → relay",
        "control; answered with RELAY_REPORT `ready` once the relay's data thread is free",
    ),
    R.Commit: ("root → relay", "control; answered with RELAY_REPORT `formed` or `failed`"),
    R.Send: (
        "root → relay",
        "data, ROUTER → the relay's data DEALER (control when that one is not connected)",
    ),
    R.Beat: ("root → relay", "control, every heartbeat"),
    R.Evict: ("root → relay", "control"),
    R.Status: ("relay → root", "control, every heartbeat"),
    R.Report: (
        "relay → root",
        "data for `received` and `acked` while its data DEALERs are connected, else control",
    ),
    R.Bye: ("relay → root", "control"),
    R.RelayState: (
        "root → inspector",
        "REP at `<bus address>.relay` (ipc:// buses), the answer to a bus INSPECT",
    ),
}

RELAY_INTRO = """\
# Relay control channel

Across hosts, a relay root next to the trainer and one relay per other host (see
[multi-host.md](multi-host.md)) speak a channel of their own over TCP. The root binds two
ZeroMQ ROUTERs and publishes their endpoints in its TCPStore (the rendezvous): `control`
under `{control_key}` and `data` under `{data_key}`. Each relay connects one DEALER to
`control` and two to `data`: its data thread's, whose routing id is the relay id (the
root sends version notices to it), and its wait thread's (anonymous). A relay root
also answers a bus INSPECT at `<bus address>.relay` with RELAY_STATE.

Every frame is one msgpack map with `proto` = {relay_proto}, `type` and exactly the fields
below (no `bus`), checked as the bus messages are: anything else is dropped and counted
(`rejected`), and a message of an unknown or ended session is answered RELAY_EVICT.
`manifest` and `workers` hold the bus protocol's [TensorSpec](#tensorspec) and
[WorkerEntry](#workerentry) records.

The bytes of a version travel on the generation's torch.distributed process group: a
header `int64[4]` = (`{magic:#x}`, generation, version, bytes), then the root slot's
bytes in `chunk_bytes` pieces, each a send/recv pair from rank 0 to every target relay
(tag 0 for the header, 1, 2, … for the chunks).
"""


INTRO = """\
# zmqsync wire protocol

<!-- Generated by tools/gen_protocol_doc.py from zmqsync/_protocol.py. Do not edit:
change the code or the generator, then run `python tools/gen_protocol_doc.py`.
tests/test_protocol_doc.py fails when this file and the code disagree. -->

One **publisher** and any number of **subscribers** on one host form a *bus*. The
weights live in a shared-memory segment that the publisher creates once; ZeroMQ
carries only small control messages, described here. This page is enough to write a
subscriber without zmqsync: pyzmq and msgpack are all it takes.

## Sockets

Only the control address is configured. The default is
`ipc://<runtime dir>/<name>.sock`, where the runtime dir is `$ZMQSYNC_RUNTIME_DIR`,
else `$XDG_RUNTIME_DIR/zmqsync`, else `<tmp>/zmqsync-<uid>`, created with mode 0700.
WELCOME names the two other endpoints.

| socket | publisher | subscriber | carries |
|---|---|---|---|
{socket_rows}

For a `tcp://host:port` address, events and acks are bound on the same host at ports
chosen by the system. `ipc://` socket files are made mode 0600. Every message is one
single-part ZeroMQ frame of at most {max_msg} bytes: `decode` refuses longer ones, and
zmqsync's receiving sockets drop them before they are read (`MAXMSGSIZE`).

## Encoding

A message is a msgpack **map** with string keys:

* `proto`: the integer {proto}. Anything else (another number, `1.0`, `true`) is refused.
* `type`: the message type in lower case (`"hello"`, `"welcome"`, …).
* `bus`: the bus id, 16 lower-case hex digits, chosen at random when a publisher starts.
  Only HELLO and INSPECT may carry an empty `bus`.
* every field of that type listed below, and nothing else. A missing field or an extra
  one makes the whole message invalid, even for fields with an obvious default.

Strings are msgpack `str` (UTF-8); byte strings (`handle`) are msgpack `bin` (pack with
`use_bin_type=True`). Lists are arrays; nested records (`TensorSpec`, `BufferInfo`,
`WorkerEntry`) are maps with the same rules. Integer fields need msgpack integers (not
floats, not booleans); float fields take any finite number. No extension types.

**Nothing received is ever unpickled.** Pickle turns bytes into code execution, so a
frame is only ever parsed as msgpack and then checked field by field (type, range,
length) against the tables below, which `decode` enforces and from which this page is
generated. An invalid message is dropped and counted (on events and acks), or answered
with ERROR (on control); it never raises into the program that received it, except that
a subscriber's `start()` fails with `ProtocolError` when the answer to its HELLO is not
a valid WELCOME.

For example RECEIVE {{bus {ex_bus}, seq 5, version 4, slot 1}} as a map (JSON shows the
bytes of `changed`, empty here, as a list of numbers):

```json
{receive_json}
```

and INSPECT with an empty bus, byte for byte:

```
{inspect_hex}
```

## Handshake and the event loop

A subscriber:

1. sends HELLO on a new REQ socket to the control address and polls for the answer
   with a deadline. Without an answer it closes that socket (linger 0) and tries again
   with a fresh one ("Lazy Pirate", {attempts} attempts sharing one deadline). ERROR
   `busy: …` may be retried until the deadline; any other ERROR means it was refused:
   give up with the reason.
2. connects a SUB socket to `WELCOME.events`, subscribes to everything (`""`), and
   waits for the frame `{xpub_welcome}`: the publisher's XPUB sends it to each new
   subscriber once its subscription is live, so from then on no event can be missed.
   That frame is not msgpack: skip it wherever it appears. Without it after a while
   (zmqsync waits a second, or two beats, then twice as long each time), connect a new
   SUB socket and wait again.
3. maps the segment (below) read-only and checks its header; connects a PUSH socket to
   `WELCOME.acks`.
4. sets `last_seq = WELCOME.seq`, applies `WELCOME.version` from `WELCOME.slot` (or the
   newer version the header names as latest: it may have been announced before the
   subscription was live), then sends ACK for the version applied.
5. then, for every event of its bus: drops RECEIVE and STOP with `seq <= last_seq`
   (already covered), else sets `last_seq = seq`. On RECEIVE it reads the version
   from the slot (seqlock below), applies it, sends ACK. On STOP with an empty session
   the bus is closed; on STOP with its own session it was evicted and may handshake
   again. Events of another bus are dropped.
6. sends HEARTBEAT on acks every `WELCOME.heartbeat` seconds, and BYE when it leaves.

The publisher sends HEARTBEAT on events every `heartbeat` seconds (default
{heartbeat} s), drops members silent for {beats} heartbeats, and on close sets the
segment header's `closed` word (below), then broadcasts STOP with an empty session. A
subscriber busy applying a version (a slow `on_update`) reads STOP only afterwards; the
`closed` word tells it at once.

## Shared segment

A CPU segment is a file in the shared-memory directory (`$ZMQSYNC_SHM_DIR`, default
`{shm}`) named `{prefix}<bus name>-<bus id>-<device without ":">`, for example
`{example_segment}`. `BufferInfo.segment` is that file name, never a path. A subscriber
opens it read-only without following symlinks, refuses anything but a regular file of
at least `BufferInfo.size` bytes, holds a shared `flock` on it for as long as it is
mapped (segments nobody holds a lock on are garbage-collected), and maps it read-only.

Layout: a header page of `header_bytes` ({header_bytes}) bytes, then `slots` slots of
`slot_bytes` bytes each (a multiple of 4096). Slot `i` starts at
`header_bytes + i × slot_bytes`; each tensor sits at its `offset` inside the slot.

The header is an array of unsigned 64-bit words in the host's byte order (little-endian
on x86-64 and arm64). `EMPTY` is 2^64-1.

| word | byte offset | meaning |
|---|---|---|
{header_rows}

At most {max_header_slots} slots fit in the header; the protocol allows {max_slots}.
The publisher writes the magic word last when it creates the segment. A subscriber
refuses a segment whose magic, slot count or slot size differ from WELCOME.

**Seqlock.** One writer, many readers, across processes. To publish version `v` into
slot `s`, the publisher makes `counter[s]` odd (`(counter + 1) | 1`) and sets
`version[s] = EMPTY`; writes the tensors; stores `version[s] = v`; makes `counter[s]`
even (`+ 1`); then updates the latest words under their own counter the same way, and
only then sends RECEIVE. To read version `v` from slot `s`, a subscriber:

1. reads `c = counter[s]`; if `c` is odd or `version[s] != v`, the slot has moved on:
   it reads the latest (version, slot) instead (words {lv} and {ls}, valid when word
   {ll} is even and unchanged across the read; `EMPTY` means none yet) and starts over
   with that. If the header names nothing newer, it waits for the next RECEIVE;
2. copies the slot's bytes (copy mode) or makes views of them (alias mode);
3. checks that `counter[s]` still equals `c`. If not, what it copied is not one whole
   version: it retries. In alias mode it keeps `(s, c)` and re-checks the counter
   after each use of the weights.

The publisher never writes a slot that a live subscriber may be reading or (alias mode)
computing with, so the check only fails with `slots=1`, after an eviction, or after a
crash.

# Message reference
"""


def _power_of_two(match: re.Match[str]) -> str:
    n = int(match.group())
    for k in range(20, 128):
        if n == 2**k:
            return f"2^{k}"
        if n == 2**k - 1:
            return f"2^{k}-1"
    return match.group()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def describe(check: Any) -> str:
    """The type/range column: the check's docstring, made readable as Markdown."""
    doc = " ".join((check.__doc__ or "").split())
    doc = re.sub(r"\b\d{7,}\b", _power_of_two, doc)
    doc = re.sub(r"map: (\w+)", lambda m: f"map: [{m[1]}](#{m[1].lower()})", doc)
    pattern = re.search(r"matching (.+?)(, not empty)?$", doc)
    if pattern:
        optional = "" if pattern[2] else ", or empty"
        doc = f"{doc[: pattern.start(1)]}`{pattern[1]}`{pattern[2] or ''}{optional}"
    return _cell(doc)


def _table(rows: Sequence[tuple[str, str, str]]) -> str:
    lines = ["| field | type / range | meaning |", "|---|---|---|"]
    lines += [f"| `{name}` | {kind} | {_cell(meaning)} |" for name, kind, meaning in rows]
    return "\n".join(lines)


def _notes(cls: type[Any]) -> str:
    dtypes = ", ".join(f"`{name}` {size}" for name, size in P.DTYPES.items())
    return NOTES[cls].format(
        beats=_config.LOST_AFTER_BEATS,
        first_word=f"{_config.FIRST_WORD_S:g}",
        rejoin_min=f"{_config.REJOIN_MIN_S:g}",
        bye_wait=_config.CLOSE_BYE_WAIT_S,
        align=P.ALIGN,
        dtypes=dtypes,
        shm=_config.DEFAULT_SHM_DIR,
        cpu_publisher=T.CPU_PUBLISHER,
        no_gpu=T.NO_GPU,
        disabled=T.DISABLED,
        ipc_bytes=T.IPC_HANDLE_BYTES,
    )


def _relay_section(cls: type[Any]) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "").replace("->", "→")
    table = R.RELAY.fields[cls]
    rows = [(name, describe(check), meaning) for name, (check, meaning) in table.items()]
    if cls not in R.RELAY.types.values():
        return "\n".join([f"## {cls.__name__}", "", doc, "", _table(rows), ""])
    direction, socket = RELAY_ROUTES[cls]
    rows = [("proto", f"int, = {R.RELAY_PROTO}", "relay protocol version"), *rows]
    rows.insert(1, ("type", f'"{cls.TYPE}"', "message type"))
    head = [f"## {cls.TYPE.upper()}", "", doc, ""]
    head += [f"**Direction:** {direction}. **Socket:** {socket}.", ""]
    return "\n".join([*head, _table(rows), ""])


def _relay_part() -> str:
    intro = RELAY_INTRO.format(
        control_key=control_key("<name>"),
        data_key=data_key("<name>"),
        relay_proto=R.RELAY_PROTO,
        magic=HEADER_MAGIC,
    )
    messages = list(R.RELAY.types.values())
    records = [cls for cls in R.RELAY.fields if cls not in messages]
    sections = [_relay_section(cls) for cls in (*messages, *records)]
    return intro + "\n" + "\n".join(sections)


def _section(cls: type[Any]) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "").replace("->", "→")
    rows = [(name, describe(check), meaning) for name, (check, meaning) in P.FIELDS[cls].items()]
    if cls in RECORDS:
        head = [f"## {cls.__name__}", "", doc, ""]
    else:
        direction, socket = ROUTES[cls]
        head = [
            f"## {cls.TYPE.upper()}",
            "",
            doc,
            "",
            f"**Direction:** {direction}. **Socket:** {socket}.",
            "",
        ]
        rows = [
            ("proto", f"int, = {P.PROTO}", "protocol version"),
            ("type", f'"{cls.TYPE}"', "message type"),
            *rows,
        ]
    return "\n".join([*head, _table(rows), "", _notes(cls), ""])


def _header_rows() -> str:
    rows = [
        (H._MAGIC, f"magic `{H.MAGIC:#018x}` (the bytes `MQSYNC_1`)"),
        (H._SLOTS, "number of slots"),
        (H._SLOT_BYTES, "bytes per slot"),
        (H._LATEST_LOCK, "latest: counter (odd while the next two words change)"),
        (H._LATEST_VERSION, "latest: version announced last (`EMPTY`: none yet)"),
        (H._LATEST_SLOT, "latest: its slot"),
        (H._CLOSED, "closed: 1 once the publisher closes the bus (set before its STOP)"),
    ]
    lines = [f"| {w} | {8 * w} | {meaning} |" for w, meaning in rows]
    first = H._FIRST_SLOT
    if first > H._CLOSED + 1:
        words = f"{H._CLOSED + 1}" + (f"–{first - 1}" if first - 1 > H._CLOSED + 1 else "")
        lines.append(f"| {words} | | reserved, 0 |")
    lines.append(f"| {first} + 2i | {8 * first} + 16i | slot i: counter (odd while written) |")
    lines.append(
        f"| {first + 1} + 2i | {8 * first + 8} + 16i | slot i: version it holds (`EMPTY`: none) |"
    )
    return "\n".join(lines)


def _intro() -> str:
    receive = P.Receive(EXAMPLE_BUS, 5, 4, 1)
    inspect_bytes = P.encode(P.Inspect(""))
    hex_lines = [
        " ".join(f"{b:02x}" for b in inspect_bytes[i : i + 16])
        for i in range(0, len(inspect_bytes), 16)
    ]
    heartbeat = inspect.signature(Publisher).parameters["heartbeat"].default
    return INTRO.format(
        max_msg=f"{P.MAX_MESSAGE} ({P.MAX_MESSAGE // 2**20} MiB)",
        proto=P.PROTO,
        socket_rows="\n".join(
            f"| {name} | {' | '.join(cells)} |" for name, cells in SOCKETS.items()
        ),
        ex_bus=EXAMPLE_BUS,
        receive_json=json.dumps(
            msgpack.unpackb(P.encode(receive)),
            indent=None,
            default=lambda b: list(b) if isinstance(b, bytes) else str(b),
        ),
        inspect_hex="\n".join(hex_lines),
        attempts=_config.HANDSHAKE_ATTEMPTS,
        xpub_welcome='b"' + repr(XPUB_WELCOME)[2:-1] + '"',
        heartbeat=heartbeat,
        beats=_config.LOST_AFTER_BEATS,
        shm=_config.DEFAULT_SHM_DIR,
        prefix=PREFIX,
        example_segment=segment_name("policy", EXAMPLE_BUS),
        header_bytes=H.HEADER_BYTES,
        header_rows=_header_rows(),
        max_header_slots=H.MAX_SLOTS,
        max_slots=P.MAX_SLOTS,
        ll=H._LATEST_LOCK,
        lv=H._LATEST_VERSION,
        ls=H._LATEST_SLOT,
    )


def render() -> str:
    """The whole of docs/protocol.md."""
    missing = [c.__name__ for c in (*P.MESSAGE_TYPES.values(), *RECORDS) if c not in NOTES]
    missing += [c.__name__ for c in P.MESSAGE_TYPES.values() if c not in ROUTES]
    missing += [c.__name__ for c in P.FIELDS if c not in (*P.MESSAGE_TYPES.values(), *RECORDS)]
    missing += [c.__name__ for c in R.RELAY.types.values() if c not in RELAY_ROUTES]
    if missing:
        raise SystemExit(f"gen_protocol_doc: describe {', '.join(missing)} in ROUTES/NOTES")
    sections = [_section(cls) for cls in (*P.MESSAGE_TYPES.values(), *RECORDS)]
    return _intro() + "\n" + "\n".join(sections) + "\n" + _relay_part()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    parser.add_argument("--output", type=Path, default=OUTPUT, help="default: docs/protocol.md")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = args.output.read_text(encoding="utf-8") if args.output.exists() else ""
        if current == text:
            return 0
        diff = difflib.unified_diff(
            current.splitlines(), text.splitlines(), str(args.output), "render()", lineterm=""
        )
        sys.stderr.write("\n".join(list(diff)[:40]) + "\n")
        sys.stderr.write(f"{args.output} is stale: run python tools/gen_protocol_doc.py\n")
        return 1
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(text, encoding="utf-8", newline="\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
