"""placeholder"""
from kvstore.policy import DEFAULT_PRIORITY
class ChainPriorityAssigner:
    def priorities(self, request, num_hit_blocks):
        return [DEFAULT_PRIORITY]*len(request.block_ids)
