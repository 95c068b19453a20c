"""MLServer in its Kafka mode as a baseline of `headrace bench`, doing headrace's work.

`env` builds MLServer's own environment; `v2` turns events into V2 inference requests
and reads the answers back (pure, shared by both sides); `runtime` is the custom
MLServer runtime (the same Feast read and ONNX run as headrace); `serve` starts MLServer
with the two shims the benchmark needs; `system` prepares and starts it for the harness.
`runtime` and `serve` run only in MLServer's environment.
"""
