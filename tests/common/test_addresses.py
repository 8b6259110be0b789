"""Service addresses: one set of rules for every address a user gives (config, CLI)."""

import re

import pytest

from neorec.common.addresses import AddressError, check_address
from neorec.common.errors import UserError


@pytest.mark.parametrize("address", ["localhost:50051", "10.0.0.7:1", "[::1]:65535", "reader-3.example:8080",
                                     "[fe80::1%eth0]:7000", "reader_3:1"])
def test_host_and_port_pass(address):
    assert check_address(address) == address


@pytest.mark.parametrize("address", ["localhost", ":50051", "localhost:", "localhost:http", "localhost:0",
                                     "localhost:65536", "localhost:-1", "127.0.0.1:127.0.0.1:4", "::1:50051",
                                     "local host:1", "[::1:50051"])
def test_anything_else_is_a_user_error_naming_it(address):
    with pytest.raises(AddressError, match=re.escape(f"store service address {address!r} is not host:port")) as caught:
        check_address(address, "store service address")
    assert isinstance(caught.value, UserError) and isinstance(caught.value, ValueError)


def test_a_config_address_error_names_the_key():
    from neorec.trainer.config import ConfigError, EmbeddingStoreConfig

    with pytest.raises(ConfigError, match="embedding_store.service: store service address 'h:0' is not host:port"):
        EmbeddingStoreConfig(service="h:0").validate()
