"""What both clients share: one gRPC channel, closed by close() or by leaving a with-block."""

import grpc


class ChannelClient:
    def __init__(self, target, timeout, options=None):
        self.target = target
        self.timeout = timeout
        self._channel = grpc.insecure_channel(target, options=options)

    def close(self):
        self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
