"""The harness's child-process helpers: the ports it starts servers on."""

from __future__ import annotations

from pathlib import Path

from bench.support.processes import free_port, port_free


def test_a_picked_port_is_one_the_kernel_never_hands_out_on_its_own():
    """Every pick is free and below the kernel's ephemeral range (its Redis Cluster bus port,
    +10000, too), so no client's connect or port-0 bind elsewhere on the host can take it
    between the pick and the server's bind (a clean clone's vLLM server lost its port so)."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    picks = [free_port() for _ in range(200)]
    assert all(port + 10_000 < ephemeral and port_free(port) for port in picks), picks
    assert len(set(picks)) > 150  # spread over the range, not one port over and over
