"""budgets"""
