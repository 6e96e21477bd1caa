"""What objects and tensor dicts look like between ranks: msgspec objects over
gloo with failure markers, and the metadata of a tensor dict."""
