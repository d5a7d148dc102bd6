"""A bare connection host for tests that drive ``_protocol.Connection`` over a socket pair."""


class Recorder:
    """A connection host that records calls and answers each with its arguments."""

    closing = False

    def __init__(self):
        self.calls = []
        self.closed = []

    def handle_call(self, conn, cid, call):
        method, args, kwargs = call
        call.clear()
        self.calls.append((method, args, kwargs))
        conn.reply(cid, args)

    def connection_eof(self, conn):
        conn.close()

    def connection_closed(self, conn):
        self.closed.append(conn)
