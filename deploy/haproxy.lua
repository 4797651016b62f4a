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

-- Bounded load for the calls with a routing key (deploy/haproxy.cfg, backend braid-affinity), as SGLang's
-- cache-aware router decides it: a call goes where its key hashes to (nil: no other replica) unless the
-- replicas are out of balance, the busiest one having more than `calls` streams in flight over the
-- least-loaded one and more than `percent`% of its streams; then to the least-loaded one. A replica's load
-- is its streams in flight in both backends. Written here because HAProxy's own bound, hash-balance-factor,
-- is a ratio to the mean streams in flight with no absolute slack: at a few calls in flight it sends calls
-- to replicas that must compute their prefix again (docs/deployment.md, "Bounded load").
core.register_fetches("braid_spill", function(txn, calls, percent)
    calls, percent = tonumber(calls), tonumber(percent)
    local braid = core.backends["braid"].servers
    local names, loads = {}, {}
    for name, server in pairs(core.backends["braid-affinity"].servers) do
        local stats = server:get_stats()
        if stats.status:sub(1, 2) == "UP" then -- "UP", or "UP 1/2" (a check failed); not DOWN, MAINT, DRAIN
            names[#names + 1] = name
            loads[name] = stats.scur + (braid[name] and braid[name]:get_stats().scur or 0)
        end
    end
    table.sort(names) -- of equally loaded replicas, the least-loaded is always the same one
    local least, most = names[1], names[1]
    for _, name in ipairs(names) do
        if loads[name] < loads[least] then least = name end
        if loads[name] > loads[most] then most = name end
    end
    if least ~= nil and loads[most] - loads[least] > calls and loads[most] * 100 > loads[least] * percent then
        return least
    end
    return nil
end)
