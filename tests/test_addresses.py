"""One rule for a Synchronizer address (`protos.channel.parse_addresses`), and every place that
takes one holding to it: the learner's settings, `diloco-synchronizer init/status` and
`diloco-learner train --synchronizer`, each naming its setting in the message."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from demo.cli import UsageError, check_address
from learner.config import LearnerConfig
from protos.channel import parse_addresses
from synchronizer.cli_remote import RemoteConfig

GOOD = {
    "127.0.0.1:50051": ["127.0.0.1:50051"],
    "localhost:1": ["localhost:1"],
    "sync.ns.svc.cluster.local:65535": ["sync.ns.svc.cluster.local:65535"],
    "[::1]:50051": ["[::1]:50051"],
    "[fd00::3]:7, a:8": ["[fd00::3]:7", "a:8"],
    " a:1 ,b:2 ": ["a:1", "b:2"],
}
BAD = {
    "localhost": "'localhost' has no port",
    "host:99999": "'host:99999' has port '99999', not a number in 1..65535",
    "host:0": "has port '0'",
    "host:": "has port ''",
    "host:http": "has port 'http'",
    "host:-1": "has port '-1'",
    ":50051": "':50051' has no host",
    "[]:50051": "'[]:50051' has no host",
    "::1:50051": "IPv6 host without brackets",
    "[::1:50051": "bracket",
    "a:1,": "an empty address",
    "a:1,,b:2": "an empty address",
    "": "an empty address",
    "a:1,localhost": "'localhost' has no port",
}


@pytest.mark.parametrize(("text", "addresses"), GOOD.items(), ids=list(GOOD))
def test_good_addresses_parse_to_their_stripped_list(text, addresses):
    assert parse_addresses(text) == addresses
    assert LearnerConfig(synchronizer=text).synchronizer == text
    assert RemoteConfig(synchronizer=text).addresses == addresses
    assert check_address(text) == text


@pytest.mark.parametrize(("text", "problem"), BAD.items(), ids=list(BAD))
def test_bad_addresses_are_refused_alike_with_what_is_wrong(text, problem):
    with pytest.raises(ValueError) as parsed:
        parse_addresses(text)
    assert problem in str(parsed.value)
    with pytest.raises(ValidationError) as learner:
        LearnerConfig(synchronizer=text)
    with pytest.raises(ValidationError) as remote:
        RemoteConfig(synchronizer=text)
    with pytest.raises(UsageError) as flag:
        check_address(text)
    for error in (learner, remote):
        (err,) = error.value.errors()
        assert err["loc"] == ("synchronizer",)
        assert "must be host:port with a port in 1..65535" in err["msg"] and problem in err["msg"]
    assert str(flag.value).startswith("--synchronizer must be HOST:PORT") and problem in str(
        flag.value
    )


def test_learner_config_also_refuses_an_address_listed_twice():
    with pytest.raises(ValidationError, match="lists an address twice"):
        LearnerConfig(synchronizer="a:1, a:1")
