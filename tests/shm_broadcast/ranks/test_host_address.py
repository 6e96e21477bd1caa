"""host_ip(): the address a queue's remote readers connect to (no root needed here;
the case of a host without a default route runs in tests/multihost)."""

from __future__ import annotations

import logging
import socket

import pytest

from shm_broadcast.ranks import host_address
from shm_broadcast.ranks.host_address import host_ip, is_loopback_host


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("GROUPCOORD_HOST_IP", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    return monkeypatch


@pytest.mark.parametrize("value,want", [("127.0.0.1", "127.0.0.1"), (" 127.0.0.2 ", "127.0.0.2"),
                                        ("::1", "::1"), ("[::1]", "::1")])
def test_the_environment_variable_wins(clean_env: pytest.MonkeyPatch, value: str,
                                       want: str) -> None:
    if ":" in want and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    clean_env.setenv("GROUPCOORD_HOST_IP", value)
    clean_env.setenv("MASTER_ADDR", "10.255.255.255")
    try:
        assert host_ip() == want
    except ValueError as e:  # a host whose loopback has no IPv6 address
        if ":" not in want:
            raise
        pytest.skip(str(e))


@pytest.mark.parametrize("value,words", [
    ("myhost", "not an IPv4 or IPv6"), ("10.0.0.300", "not an IPv4 or IPv6"),
    ("0.0.0.0", "wildcard"), ("::", "wildcard"), ("224.0.0.1", "multicast"),
    ("192.0.2.7", "not an address of this host")],  # TEST-NET-1: assigned nowhere
    ids=["name", "bad-octet", "wildcard", "wildcard6", "multicast", "not-assigned"])
def test_a_bad_environment_variable_is_refused_naming_it(clean_env: pytest.MonkeyPatch,
                                                         value: str, words: str) -> None:
    clean_env.setenv("GROUPCOORD_HOST_IP", value)
    with pytest.raises(ValueError, match="GROUPCOORD_HOST_IP") as info:
        host_ip()
    assert words in str(info.value) and repr(value) in str(info.value)


@pytest.mark.parametrize("master", ["127.0.0.1", "localhost", "::1", "no-such-host.invalid",
                                    "not an address"],
                         ids=["loopback", "localhost", "loopback6", "unresolvable", "garbage"])
def test_a_master_addr_that_gives_no_usable_route_is_skipped(clean_env: pytest.MonkeyPatch,
                                                             master: str) -> None:
    without = host_ip()
    clean_env.setenv("MASTER_ADDR", master)
    assert host_ip() == without


def test_the_route_to_master_addr_comes_first(clean_env: pytest.MonkeyPatch) -> None:
    """The source address towards MASTER_ADDR is used even when another source exists."""
    src = host_address._route_source("8.8.8.8") or host_address._route_source("10.255.255.255")
    if src is None:
        pytest.skip("this machine has no route off loopback")
    calls = []
    real = host_address._route_source

    def spy(target: str) -> str | None:
        calls.append(target)
        return real(target)

    clean_env.setattr(host_address, "_route_source", spy)
    clean_env.setenv("MASTER_ADDR", src)  # our own address: the route's source is itself
    assert host_ip() == src
    assert calls[0] == src


def test_loopback_is_the_last_resort_and_is_logged(clean_env: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    clean_env.setattr(host_address, "_route_source", lambda target: None)
    clean_env.setattr(host_address, "_own_name_address", lambda: None)
    with caplog.at_level(logging.WARNING, logger="shm_broadcast.ranks.host_address"):
        assert host_ip() == "127.0.0.1"
    assert "GROUPCOORD_HOST_IP" in caplog.text and "127.0.0.1" in caplog.text


@pytest.mark.parametrize("ip,usable", [("127.0.0.1", False), ("::1", False), ("0.0.0.0", False),
                                       ("224.0.0.1", False), ("10.213.0.2", True),
                                       ("fe80::1%eth0", True), ("nonsense", False)])
def test_usable_addresses(ip: str, usable: bool) -> None:
    assert host_address._usable(ip) is usable


@pytest.mark.parametrize("host,loopback", [
    ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("10.1.2.3", False), ("2001:db8::1", False), ("fe80::1%lo", False)])
def test_loopback_hosts(host: str, loopback: bool) -> None:
    assert is_loopback_host(host) is loopback
