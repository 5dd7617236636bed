"""Layer 1, the layout algebra (pure Python, no processes): partition specs, meshes, layouts —
local shard shapes and slices, placements, validation with clear errors."""
