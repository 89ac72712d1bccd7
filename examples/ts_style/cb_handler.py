"""An unmodified TorchServe continuous-batching handler (the pattern of TorchServe's streaming tests).

State lives in ``ctx.cache[req_id]``; ``context.stopping_criteria`` says per request whether to stop,
and the criterion frees the request's state when it does. Body ``{"n": N}``: N steps, each returning
``{"step": k, "of": N}``. No cancel hook: as in TorchServe, a cancelled id just stops appearing.
"""

import json
import logging

from ts.context import Context
from ts.torch_handler.base_handler import BaseHandler

logger = logging.getLogger(__name__)


class CountingHandler(BaseHandler):
    def initialize(self, ctx: Context):
        ctx.cache = {}
        self.context = ctx
        self.initialized = True

    def preprocess(self, data):
        for req_id, row in zip(self.context.request_ids.values(), data):
            if req_id not in self.context.cache:
                body = row.get("body")
                if isinstance(body, (bytes, bytearray, str)):
                    body = json.loads(body)
                self.context.cache[req_id] = {
                    "n": int(body["n"]),
                    "k": 0,
                    "stopping_criteria": self._create_stopping_criteria(req_id),
                }
        return list(self.context.request_ids.values())

    def inference(self, req_ids, *args, **kwargs):
        out = []
        for req_id in req_ids:
            state = self.context.cache[req_id]
            out.append({"step": state["k"], "of": state["n"]})
            state["k"] += 1
        return out

    def postprocess(self, data):
        self.context.stopping_criteria = [
            self.context.cache[req_id]["stopping_criteria"] for req_id in self.context.request_ids.values()
        ]
        return data

    def _create_stopping_criteria(self, req_id):
        cache = self.context.cache

        def stop(result):
            if result["step"] + 1 >= result["of"]:
                del cache[req_id]
                return True
            return False

        return stop
