"""The endpoint picker (`shepherd epp`): shepherd's routing policies as an Envoy ext_proc service.

    picker.py    the ext_proc stream (Gateway API Inference Extension's endpoint-picker protocol)
    epp_cli.py   `shepherd epp`: endpoints, policy, KV events, the gRPC server

Needs the `epp` extra (grpcio, xds-protos): `pip install -e '.[epp]'` (`make test` installs it).
"""
