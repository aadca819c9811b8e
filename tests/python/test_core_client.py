"""tensorshare.Client at the edges: arguments with NUL characters, and what a get that took
items out of a bin does when their conversion fails."""
import pytest
import torch

import tensorshare


def test_nul_in_token_or_address_is_refused(tensord):
    with pytest.raises(ValueError):
        tensorshare.Client(tensord.address, token="s3cret\0ignored")
    with pytest.raises(ValueError):
        tensorshare.Client(tensord.address + "\0junk")
