"""signer: owns the node's Ed25519 key and signs attested reports, nothing else.

It runs as its own user; the key file is created 0600 at first start and the
service refuses to start on a key file others can read. It stamps node id,
boot id and time into the report body itself, so no caller can forge them.
"""
