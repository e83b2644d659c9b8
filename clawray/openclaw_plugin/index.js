// clawray's OpenClaw plugin (loaded through plugins.load.paths; written by clawray.openclaw.write_config
// with session_headers=True). OpenClaw sends no per-request headers of its own; its provider-plugin
// hook resolveTransportTurnState (plugin SDK, "Native transport identity") adds headers to every
// request of a provider's stream transport. For the clawray provider it sends the OpenClaw session id
// as X-Session-Id, so clawray records the conversation under that id instead of inferring it.
// Housekeeping requests (memory flush, compaction summaries) carry their session id too; clawray
// still recognises them as side turns from their content (docs/openclaw.md).
export default {
  id: "clawray-session",
  name: "clawray session headers",
  description: "Sends each request's OpenClaw session id to the clawray provider as the X-Session-Id header",
  register(api) {
    api.registerProvider({
      id: "clawray",
      label: "clawray",
      auth: [],
      resolveTransportTurnState: (ctx) => (ctx.sessionId ? { headers: { "X-Session-Id": ctx.sessionId } } : undefined),
    });
  },
};
