"""The floor for ``kvd bench pipeline``: a bare PULL -> decode -> encode -> PUB relay.

It does the least any daemon in kvd's place must do per notification: receive it, decode the
ReadDone, encode a Ready and publish it with a topic and sequence number, in a blocking loop.
Two flavours: ``api`` uses pyzmq's public API (``recv``, ``send_multipart``), the relay anyone
would write; ``raw`` uses the compiled socket methods kvd itself uses on its hot path
(``kvd.daemon.zmq_io.raw_recv``/``raw_send``), so that the ratio against it measures kvd's own
work.

Run as ``python -m kvd.bench.relay {api|raw} INGEST EVENTS``; it prints ``ready`` once bound.
"""

from __future__ import annotations

import sys

import msgspec
import zmq

from kvd.daemon.zmq_io import raw_recv, raw_send
from kvd.protocol import ReadDone, Ready, encode_seq

_MORE = int(zmq.SNDMORE)


def main(argv: list[str]) -> int:
    flavour, ingest_endpoint, events_endpoint = argv
    if flavour not in ("api", "raw"):
        print(f"relay: flavour must be api or raw, got {flavour!r}", file=sys.stderr)
        return 2
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, 0)
    pull.bind(ingest_endpoint)
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 1_000_000)
    pub.bind(events_endpoint)
    decoder = msgspec.msgpack.Decoder(ReadDone)
    encoder = msgspec.msgpack.Encoder()
    seqs: dict[str, int] = {}
    print("ready", flush=True)
    raw = flavour == "raw"
    while True:
        msg = decoder.decode(raw_recv(pull) if raw else pull.recv())
        seq = seqs.get(msg.cache_id, 0) + 1
        seqs[msg.cache_id] = seq
        payload = encoder.encode(
            Ready(
                req_id=msg.req_id,
                cache_id=msg.cache_id,
                physical_block_ids=msg.physical_block_ids,
                remote_engine_id=msg.remote_engine_id,
            )
        )
        topic = msg.cache_id.encode()
        if raw:
            raw_send(pub, topic, _MORE)
            raw_send(pub, encode_seq(seq), _MORE)
            raw_send(pub, payload)
        else:
            pub.send_multipart((topic, encode_seq(seq), payload))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
