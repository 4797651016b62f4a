-- Loaded by deploy/haproxy.cfg. A replica that answers a call UNAVAILABLE is draining (braid refuses
-- new calls from SIGTERM on) or has lost its model thread: it leaves the rotation at once instead of
-- at its next failed health check, and the health check puts it back once it is SERVING again.
-- The call itself goes back to its client, whose retry policy sends it again, now to another replica.
-- The server is forced down in backend braid, whose health checks the braid-affinity backend's
-- servers track (deploy/haproxy.cfg): both take it out.
core.register_action("braid_unavailable", { "http-res" }, function(txn)
    local backend = core.backends["braid"]
    local server = backend and backend.servers[txn.sf:srv_name()]
    if server ~= nil then
        server:check_force_down()
    end
end)
