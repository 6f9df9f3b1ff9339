"""The vLLM bench's own plumbing, without vLLM: the ports it gives vLLM's instances."""

from __future__ import annotations

from kvd.bench.vllm import ephemeral_ports, free_port


def test_side_channel_ports_are_never_ones_the_kernel_gives_to_connections() -> None:
    ephemeral = ephemeral_ports()
    ports = [free_port() for _ in range(50)]
    assert not [p for p in ports if p in ephemeral], ephemeral
    assert len(set(ports)) == len(ports), "a port was handed out twice"
